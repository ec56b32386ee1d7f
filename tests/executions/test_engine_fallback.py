"""Fresh fallback (SPEC §6.4) and binding: with the policy, the next attempt after the original
connection's retries starts a fresh session elsewhere, its prompt rebuilt from the issue record;
without it, the attempt stays bound and the run waits host_offline."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from executions import engine, services
from executions.models import Attempt, Run
from sessions_app import bridge
from sessions_app.models import Connection
from tests import factories

pytestmark = pytest.mark.django_db


def live(connection):
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    return Connection.objects.get(pk=connection.pk)


def lose(run, connection):
    """The attempt's turn runs, then its machine goes away."""
    attempt = Attempt.objects.filter(task__node__run=run).order_by("-created_at").first()
    for body in ({"status": "running"}, {"status": "interrupted", "reason": "shutdown"}):
        bridge._apply_advance(connection, attempt.turn_id, {"report_id": str(uuid.uuid4()), **body})
    Connection.objects.filter(pk=connection.pk).update(status="offline")
    engine.run_tick_apply(run_id=run.pk)
    return attempt


def test_fresh_fallback_moves_to_another_connection_with_a_rebuilt_prompt():
    original = live(factories.make_connection(cwds=["/srv/a"]))
    fallback = factories.make_connection(cwds=["/srv/b"])
    issue = factories.make_issue(title="Fix login")
    services.comment_add(issue_id=issue.pk, body="The bug is in auth.py line 40", author="alice")
    run = engine.run_start(issue_id=issue.pk, mode="direct", input={"prompt": "@outcome succeeded"},
                           target={"connection": str(original.pk)},
                           policy={"infra_retries": 0, "fresh_fallback": True, "fallback_backends": ["scripted"]})
    engine.run_tick_apply(run_id=run.pk)
    first = lose(run, original)
    live(fallback)
    engine.run_tick_apply(run_id=run.pk)
    second = Attempt.objects.filter(task__node__run=run).order_by("-created_at").first()
    assert second.pk != first.pk and second.task_id == first.task_id
    assert second.connection_id == fallback.pk and second.session_id != first.session_id
    assert second.session.idea_key.endswith(":fresh")
    assert "The bug is in auth.py line 40" in second.turn.prompt  # rebuilt from the issue's record


def test_without_fallback_the_attempt_stays_bound_and_the_run_waits_host_offline():
    original = live(factories.make_connection(cwds=["/srv/a"]))
    other = live(factories.make_connection(cwds=["/srv/b"]))
    issue = factories.make_issue()
    run = engine.run_start(issue_id=issue.pk, mode="direct", input={"prompt": "@outcome succeeded"},
                           policy={"infra_retries": 2})
    engine.run_tick_apply(run_id=run.pk)
    bound = Attempt.objects.get(task__node__run=run).connection
    lose(run, bound)
    live(other if bound.pk == original.pk else original)
    engine.run_tick_apply(run_id=run.pk)
    run = Run.objects.get(pk=run.pk)
    assert (run.state, run.wait_reason) == ("waiting", "retry_backoff")  # attempt 2 only after a backoff
    from executions.models import AgentTask

    task = AgentTask.objects.get(node__run=run)
    AgentTask.objects.filter(pk=task.pk).update(result={"retry_after": "2000-01-01T00:00:00+00:00"})  # time passes
    engine.run_tick_apply(run_id=run.pk)
    run = Run.objects.get(pk=run.pk)
    assert (run.state, run.wait_reason) == ("waiting", "host_offline")
    assert Attempt.objects.filter(task__node__run=run).count() == 1


def finish_with(connection, attempt, intent, **extra):
    from chorus_site.events import event_append

    turn = attempt.turn
    bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "running"})
    event_append(stream=turn.stream, kind="turn.output",
                 data={"id": str(turn.pk), "type": "outcome", "data": {"intent": intent, **extra}})
    bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "ended"})
    engine.run_tick_apply(run_id=attempt.task.node.run_id)


def test_waiting_outcome_continues_by_itself_when_the_dependency_is_done():
    connection = live(factories.make_connection(cwds=["/srv/a"]))
    dependency = factories.make_issue(title="API first")
    run = engine.run_start(issue_id=factories.make_issue().pk, mode="direct", input={"prompt": "@outcome waiting"},
                           target={"connection": str(connection.pk)})
    engine.run_tick_apply(run_id=run.pk)
    attempt = Attempt.objects.get(task__node__run=run)
    finish_with(connection, attempt, "waiting", ref=str(dependency.pk))
    run.refresh_from_db()
    attempt.refresh_from_db()
    assert (run.state, run.wait_reason) == ("waiting", "dependency")
    assert attempt.state == "waiting"
    engine.run_tick_apply(run_id=run.pk)
    assert Attempt.objects.get(pk=attempt.pk).state == "waiting"  # nothing moves before the dependency is done
    from executions.models import Issue

    Issue.objects.filter(pk=dependency.pk).update(status="done")
    engine.run_tick_apply(run_id=run.pk)
    attempt.refresh_from_db()
    assert attempt.state == "running" and "API first" not in attempt.turn.prompt
    assert str(dependency.pk) in attempt.turn.prompt and attempt.turn.session_id == attempt.session_id


def test_blocked_outcome_keeps_work_and_waits_for_a_person():
    connection = live(factories.make_connection(cwds=["/srv/a"]))
    run = engine.run_start(issue_id=factories.make_issue().pk, mode="direct", input={"prompt": "@outcome blocked"},
                           target={"connection": str(connection.pk)})
    engine.run_tick_apply(run_id=run.pk)
    attempt = Attempt.objects.get(task__node__run=run)
    finish_with(connection, attempt, "blocked", summary="needs database credentials")
    node = run.nodes.get()
    assert (node.state, node.wait_reason) == ("waiting", "blocked")
    assert "credentials" in node.wait_detail["summary"]
    engine.run_tick_apply(run_id=run.pk)
    assert Attempt.objects.filter(task__node__run=run).count() == 1  # no automatic retry
    assert Run.objects.get(pk=run.pk).state == "waiting"


def declared(nodes, connection):
    from executions.workflows import workflow_create

    revision = workflow_create(name=factories.unique("wf"), spec={"nodes": nodes})
    run = engine.run_start(issue_id=factories.make_issue().pk, mode="declared", workflow_revision_id=revision.pk,
                           target={"connection": str(connection.pk)})
    engine.run_tick_apply(run_id=run.pk)
    return run


def test_a_due_timer_readies_its_dependents_in_the_same_tick_and_nodes_keep_workflow_order():
    connection = live(factories.make_connection(cwds=["/srv/a"]))
    keys = ["wait", "after", "z-last", "a-first"]
    run = declared([{"key": "wait", "type": "timer", "seconds": 0},
                    {"key": "after", "type": "agent", "depends_on": ["wait"], "prompt": "@outcome succeeded"},
                    {"key": "z-last", "type": "approval", "depends_on": ["after"]},
                    {"key": "a-first", "type": "approval", "depends_on": ["z-last"]}], connection)
    engine.run_tick_apply(run_id=run.pk)
    assert list(run.nodes.order_by("id").values_list("key", flat=True)) == keys
    after = run.nodes.get(key="after")
    assert after.state == "running" and Attempt.objects.filter(task__node=after).exists()


def test_the_last_attempt_finishing_while_paused_completes_the_run_once_resumed():
    from executions.actions import run_pause, run_resume

    connection = live(factories.make_connection(cwds=["/srv/a"]))
    run = declared([{"key": "only", "type": "agent", "prompt": "@outcome succeeded"}], connection)
    run_pause(actor=None, run_id=run.pk)
    attempt = Attempt.objects.get(task__node__run=run)
    finish_with(connection, attempt, "succeeded")
    assert Run.objects.get(pk=run.pk).state == "paused"  # pause means no progress (issue 7 item 12)
    run_resume(actor=None, run_id=run.pk)
    engine.run_tick_apply(run_id=run.pk)
    assert Run.objects.get(pk=run.pk).state == "succeeded"


def test_a_question_parks_the_attempt_and_the_answer_continues_it():
    connection = live(factories.make_connection(cwds=["/srv/a"]))
    run = declared([{"key": "ask", "type": "agent", "prompt": "@require-approval Deploy?"}], connection)
    attempt = Attempt.objects.get(task__node__run=run)
    turn = attempt.turn
    ask = {"kind": "confirmation", "items": [{"id": "q1", "text": "Deploy?"}]}
    bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "running"})
    bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "requires_action",
                                                "requires_action": ask})
    engine.run_tick_apply(run_id=run.pk)
    run.refresh_from_db()
    assert (run.state, run.wait_reason) == ("waiting", "approval")
    assert Attempt.objects.get(pk=attempt.pk).state == "waiting"
    from sessions_app.actions import turn_answer

    answer = turn_answer(actor=None, turn_id=turn.pk, answers=[{"id": "q1", "answer": "yes"}])
    engine.run_tick_apply(run_id=run.pk)
    attempt.refresh_from_db()
    assert str(attempt.turn_id) == answer["turn"]  # the answer's turn belongs to the same attempt
    finish_with(connection, attempt, "succeeded")
    assert Run.objects.get(pk=run.pk).state == "succeeded"
