"""A lost tick is found again from the database (issue 7 items 1 and 2, and the periodic tick's
isolation): each test loses the tick message the way production can — the listener's after-commit
callback never runs here, as when the worker holding the message was SIGKILLed — and asks the
periodic sweep whether the run needs one."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from chorus_site.celery import app
from executions import actions, engine, services
from executions.models import Attempt, Run, RunNode
from executions.recovery import runs_needing_a_tick
from executions.tasks import runs_tick_waiting
from executions.workflows import workflow_create
from sessions_app import bridge
from sessions_app.models import Connection, Turn
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def connection():
    connection = factories.make_connection(cwds=["/srv/a"], max_concurrency=10)
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    return Connection.objects.get(pk=connection.pk)


@pytest.fixture
def eager(monkeypatch, settings):
    """Celery runs what is enqueued in-process (as in embedded mode): the real tasks, no broker."""
    monkeypatch.setitem(app.conf, "task_always_eager", True)
    settings.CELERY_TASK_ALWAYS_EAGER = True


def direct_run(connection) -> Run:
    run = engine.run_start(issue_id=factories.make_issue().pk, mode="direct", input={"prompt": "@outcome succeeded"},
                           target={"connection": str(connection.pk)})
    engine.run_tick_apply(run_id=run.pk)
    return run


def declared_run(connection, nodes) -> Run:
    revision = workflow_create(name=factories.unique("wf"), spec={"nodes": nodes})
    run = engine.run_start(issue_id=factories.make_issue().pk, mode="declared", workflow_revision_id=revision.pk,
                           target={"connection": str(connection.pk)})
    engine.run_tick_apply(run_id=run.pk)
    return run


def advance(connection, turn_id, **report):
    bridge._apply_advance(connection, turn_id, {"report_id": str(uuid.uuid4()), **report})


def end_attempt(connection, run, *, intent="succeeded"):
    """The attempt's agent runs, reports its outcome and exits; the engine is not told (lost tick)."""
    attempt = Attempt.objects.filter(task__node__run=run).exclude(state__in=["succeeded", "failed", "cancelled"]) \
        .get()
    advance(connection, attempt.turn_id, status="running")
    services.attempt_record_outcome(attempt_id=attempt.pk, intent=intent)
    advance(connection, attempt.turn_id, status="ended", final_reply="done")
    return attempt


def test_a_running_run_whose_attempts_turn_ended_is_ticked_again(connection):
    run = direct_run(connection)
    end_attempt(connection, run)
    assert Run.objects.get(pk=run.pk).state == "running"
    assert str(run.pk) in runs_needing_a_tick()
    engine.run_tick_apply(run_id=run.pk)
    assert Run.objects.get(pk=run.pk).state == "succeeded"
    assert str(run.pk) not in runs_needing_a_tick()


def test_a_pending_node_whose_dependency_was_decided_is_ticked_again(connection, operator):
    run = declared_run(connection, [{"key": "work", "type": "agent", "prompt": "@sleep 60"},
                                    {"key": "deploy", "type": "signal", "signal": "deployed"},
                                    {"key": "after", "type": "agent", "prompt": "@outcome succeeded",
                                     "depends_on": ["deploy"]}])
    assert Run.objects.get(pk=run.pk).state == "running"  # "work" runs
    actions.run_signal(actor=operator, run_id=run.pk, name="deployed")  # its tick is lost
    assert RunNode.objects.get(run=run, key="after").state == "pending"
    assert str(run.pk) in runs_needing_a_tick()
    engine.run_tick_apply(run_id=run.pk)
    assert RunNode.objects.get(run=run, key="after").state == "running"


def test_a_cancelling_run_whose_turn_ended_is_ticked_again(connection, operator):
    run = direct_run(connection)
    turn = Attempt.objects.get(task__node__run=run).turn
    advance(connection, turn.pk, status="running")
    actions.run_cancel(actor=operator, run_id=run.pk)
    advance(connection, turn.pk, status="interrupted", reason="user", stop_state="confirmed")
    assert str(run.pk) in runs_needing_a_tick()
    engine.run_tick_apply(run_id=run.pk)
    assert Run.objects.get(pk=run.pk).state == "cancelled"
    assert str(run.pk) not in runs_needing_a_tick()


def test_a_run_with_nothing_to_do_is_not_ticked(connection):
    run = direct_run(connection)
    advance(connection, Attempt.objects.get(task__node__run=run).turn_id, status="running")
    engine.run_tick_apply(run_id=run.pk)
    assert str(run.pk) not in runs_needing_a_tick()  # its agent works: nothing to do until its turn changes


def test_resume_of_a_running_run_nudges_a_tick(connection, operator, eager, django_capture_on_commit_callbacks):
    run = direct_run(connection)
    end_attempt(connection, run)  # the tick that would finish it is lost
    with django_capture_on_commit_callbacks(execute=True):
        answer = actions.run_resume(actor=operator, run_id=run.pk)
    assert answer["changed"] is False
    assert Run.objects.get(pk=run.pk).state == "succeeded"


def test_one_failing_run_does_not_keep_the_periodic_tick_from_the_others(connection, eager):
    healthy = [direct_run(connection) for _ in range(3)]
    for run in healthy:
        end_attempt(connection, run)
    broken = declared_run(connection, [{"key": "later", "type": "timer", "seconds": 60}])
    # A row the tick cannot read (written by an older version, say): its tick raises.
    RunNode.objects.filter(run=broken).update(wait_detail={"until": 5})
    assert Run.objects.get(pk=broken.pk).state == "waiting"

    runs_tick_waiting()

    assert [Run.objects.get(pk=run.pk).state for run in healthy] == ["succeeded"] * 3
    assert Turn.objects.filter(attempt_id__in=Attempt.objects.filter(task__node__run__in=healthy)
                               .values("pk")).count() == 3  # one turn per attempt: nothing done twice
