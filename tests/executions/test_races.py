"""Races at the action and engine layer (issue 7 items 4 and 5), run for real on PostgreSQL.

Each pair is released at once by ``run_together`` many times over.  A deadlock shows up as an
``OperationalError``/``DeadlockDetected`` in the outcomes, a lost ordinal race as an
``IntegrityError``; either is a failure.  Each pair must also end in exactly one outcome.
"""

from __future__ import annotations

import json
import uuid

import pytest
from django.test import Client

from executions import actions, engine
from executions.models import AgentTask, Artifact, Attempt, Comment, Run, RunNode
from executions.task_tokens import task_token_for
from tests import factories
from tests.concurrency import run_together

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 20


def agent_post(token, url, body, expected=201):
    response = Client().post(url, data=json.dumps(body), content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {token}")
    assert expected is None or response.status_code == expected, (response.status_code, response.content[:300])
    return response


def attempt_whose_turn_ended(session):
    """A run whose only attempt's turn has ended: the next tick finishes the attempt, the task, the
    node and the run, and moves the issue on (many rows, many events)."""
    connection = session.connection
    issue = factories.make_issue(status="in_progress")
    run, node, task, attempt = factories.make_run_graph(issue=issue, connection=connection)
    turn = factories.make_turn(session=session, status="ended", attempt_id=attempt.pk)
    Attempt.objects.filter(pk=attempt.pk).update(turn=turn, session=session)
    return run, attempt


def tick(run):
    return lambda: engine.run_tick_apply(run_id=run.pk)


def test_an_agents_artifact_comment_and_outcome_and_the_tick_do_not_deadlock():
    # All three talk-back routes against the tick that ends the attempt, at once.  The artifact and
    # the comment always land.  The outcome lands before the tick (the run succeeds with it) or after
    # it (the attempt has ended without one: refused, and the run fails): never recorded and then
    # ignored, never a deadlock.
    session = factories.make_session()
    for n in range(ROUNDS):
        run, attempt = attempt_whose_turn_ended(session)
        token = task_token_for(attempt)
        answers = []

        def outcome():
            response = agent_post(token, f"/api/v1/attempts/{attempt.pk}/outcome",
                                  {"intent": "succeeded", "summary": "done"}, expected=None)
            answers.append(response.status_code)
            assert response.status_code in {200, 409}, response.content[:300]

        outcomes = run_together(
            lambda: agent_post(token, "/api/v1/artifacts", {"kind": "report", "name": f"r{n}.md", "content": "# ok"}),
            lambda: agent_post(token, f"/api/v1/issues/{run.issue_id}/comments", {"body": "progress: 90%",
                                                                                 "type": "progress"}),
            outcome,
            tick(run),
        )
        assert outcomes == ["ok", "ok", "ok", "ok"], outcomes
        assert Artifact.objects.filter(run=run, attempt=attempt).count() == 1
        assert Comment.objects.filter(issue_id=run.issue_id, source_attempt=attempt).count() == 1
        [status] = answers
        stored = Run.objects.get(pk=run.pk)
        assert (status, stored.state) in {(200, "succeeded"), (409, "failed")}, (status, stored.state)
        assert Attempt.objects.get(pk=attempt.pk).state == ("succeeded" if status == 200 else "failed")


def failed_task(*, max_task_retries=0):
    """A running run whose node's only task failed (no active attempt, no live worker anywhere)."""
    run = factories.make_run(state="running", target={"backend": "codex"})
    node = factories.make_node(run=run, key="main", state="running",
                               config={"prompt": "do it", "retry": {"max_task_retries": max_task_retries}})
    task = factories.make_task(node=node, status="failed")
    factories.make_attempt(task=task, state="failed")
    return run, node, task


def retry(operator, task):
    result = {}

    def call():
        result.update(actions.task_retry(actor=operator, task_id=task.pk, reason="try again"))

    return call, result


def test_two_operator_retries_make_one_new_task(operator):
    for _ in range(ROUNDS):
        run, node, task = failed_task()
        first, first_result = retry(operator, task)
        second, second_result = retry(operator, task)
        outcomes = run_together(first, second)
        assert outcomes == ["ok", "ok"], outcomes
        assert sorted([first_result["changed"], second_result["changed"]]) == [False, True]
        new = AgentTask.objects.filter(node=node).exclude(pk=task.pk)
        assert [(t.ordinal, t.retry_of_id) for t in new] == [(2, task.pk)]
        # The one that did not act names the task that did.
        assert first_result["task"] == second_result["task"] == str(new.get().pk)


def test_an_operator_retry_and_the_engines_own_retry_make_one_new_task(operator):
    # The node's policy allows one task retry: the tick makes task 2 by itself, exactly when the
    # operator asks for it.
    for _ in range(ROUNDS):
        run, node, task = failed_task(max_task_retries=1)
        call, result = retry(operator, task)
        outcomes = run_together(call, tick(run))
        assert outcomes == ["ok", "ok"], outcomes
        tasks = list(AgentTask.objects.filter(node=node).order_by("ordinal"))
        assert [(t.ordinal, t.retry_of_id) for t in tasks] == [(1, None), (2, task.pk)]
        assert result["task"] == str(tasks[1].pk)
        assert Run.objects.get(pk=run.pk).state in {"running", "waiting"}
        assert RunNode.objects.get(pk=node.pk).state not in {"failed", "succeeded"}


def test_a_retry_of_a_task_already_retried_changes_nothing(operator):
    run, node, task = failed_task()
    made = actions.task_retry(actor=operator, task_id=task.pk)
    again = actions.task_retry(actor=operator, task_id=task.pk)
    assert made["changed"] is True and again == {**again, "changed": False, "task": made["task"]}
    assert AgentTask.objects.filter(node=node).count() == 2
    with pytest.raises(Exception) as refused:
        actions.task_retry(actor=operator, task_id=uuid.uuid4())
    assert getattr(refused.value, "code", None) == "not_found"


def test_a_reopen_and_the_tick_that_ends_its_attempt_have_one_outcome():
    """Issue 7 item 3: a turn settled offline whose daemon comes back holding it, while a tick acts on
    the settle.  Either the reopen commits first (the turn runs, its attempt goes on) or the tick does
    (the attempt failed and will be retried; the reopen is refused and the daemon told to stop the
    process): never a running turn of an ended attempt, whose work the retry would do again."""
    from django.utils import timezone

    from executions.states import ATTEMPT_TERMINAL
    from sessions_app import reconcile

    connection = factories.make_connection()
    outcomes = []
    for n in range(ROUNDS):
        session = factories.make_session(connection=connection)
        run, node, task, attempt = factories.make_run_graph(issue=factories.make_issue(status="in_progress"),
                                                            connection=connection)
        turn = factories.make_turn(session=session, status="interrupted", interrupted_reason="offline",
                                   attempt_id=attempt.pk, connection=connection, ended_at=timezone.now())
        Attempt.objects.filter(pk=attempt.pk).update(turn=turn, session=session)
        answers = run_together(tick(run), lambda: reconcile.turn_reconcile_held(
            connection_id=connection.pk, turn_id=turn.pk, evidence={"basis": "snapshot"}))
        assert answers == ["ok", "ok"], answers
        turn.refresh_from_db()
        state = Attempt.objects.get(pk=attempt.pk).state
        if turn.status == "running":
            assert state not in ATTEMPT_TERMINAL, state
            outcomes.append("reopened")
        else:
            assert (turn.status, turn.interrupted_reason, turn.stop_state, state) == (
                "interrupted", "offline", "requested", "failed")
            outcomes.append("stopped")
    assert outcomes  # which one wins each round is up to the scheduler
