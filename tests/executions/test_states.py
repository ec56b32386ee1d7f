"""The executions state machines (SPEC §3.2), table-driven from ``executions/states.py``.

Every allowed pair goes through its service and writes exactly one event on the right stream;
every other pair (repeating the current state included) is refused with ``invalid_transition``
and changes nothing: same row (version included), no event.
"""

from __future__ import annotations

import uuid

import pytest

from chorus_site.errors import ApplicationError
from executions import services, states
from executions.models import AgentTask, Approval, Attempt, Issue, Run, RunNode
from tests.factories import (
    events_since,
    last_event_id,
    make_approval,
    make_attempt,
    make_issue,
    make_node,
    make_run,
    make_task,
    make_user,
)
from tests.state_machines import assert_one_event, assert_refused, ids, pairs
from tests.concurrency import run_together


# ---------------------------------------------------------------- the tables against SPEC §3.2
def _spec(text: str) -> dict[str, set[str]]:
    table: dict[str, set[str]] = {}
    for part in text.split(";"):
        source, targets = part.split("→")
        for name in source.split("/"):
            table.setdefault(name.strip(), set()).update(t.strip() for t in targets.split("/"))
    return table


def test_tables_are_the_ones_of_the_spec():
    assert states.RUN_TRANSITIONS == _spec(
        "planned→running/cancelling/cancelled/failed; running→waiting/paused/cancelling/succeeded/partial_succeeded/"
        "failed; waiting→running/paused/cancelling/succeeded/partial_succeeded/failed; paused→running/waiting/"
        "cancelling; cancelling→cancelled"
    )
    assert states.NODE_TRANSITIONS == _spec(
        "pending→ready/skipped/cancelled; ready→running/waiting/skipped/failed/cancelled; running→waiting/succeeded/"
        "failed/cancelled; waiting→ready/running/succeeded/failed/cancelled"
    )
    assert states.TASK_TRANSITIONS == _spec(
        "queued→dispatched/cancelled/failed; dispatched→queued/running/waiting/failed/cancelled; running→queued/"
        "waiting/completed/failed/cancelled; waiting→queued/running/failed/cancelled"
    )
    # queued→assigned→preparing→running; running⇄waiting; running/waiting→succeeded/failed;
    # any non-terminal→cancel_requested or failed; cancel_requested→cancelled/failed
    non_terminal = set(states.ATTEMPT_STATES) - states.ATTEMPT_TERMINAL
    attempt = _spec("queued→assigned; assigned→preparing; preparing→running; running→waiting; waiting→running; "
                    "running/waiting→succeeded/failed; cancel_requested→cancelled/failed")
    for state in non_terminal:
        attempt.setdefault(state, set()).update({"cancel_requested", "failed"} - {state})
    assert states.ATTEMPT_TRANSITIONS == attempt
    # backlog→todo→in_progress→in_review→done; in_review→in_progress; any→blocked→previous;
    # any non-terminal→cancelled; done→in_progress
    assert states.ISSUE_TRANSITIONS == _spec(
        "backlog→todo/blocked/cancelled; todo→in_progress/blocked/cancelled; in_progress→in_review/blocked/cancelled; "
        "in_review→done/in_progress/blocked/cancelled; blocked→backlog/todo/in_progress/in_review/cancelled; "
        "done→in_progress"
    )
    # §4.7: cancelling a run (or its parent) cancels its pending approvals.
    assert states.APPROVAL_TRANSITIONS == {"pending": {"approved", "rejected", "cancelled"}}
    for table, terminal in [(states.RUN_TRANSITIONS, states.RUN_TERMINAL), (states.NODE_TRANSITIONS,
                            states.NODE_TERMINAL), (states.TASK_TRANSITIONS, states.TASK_TERMINAL),
                            (states.ATTEMPT_TRANSITIONS, states.ATTEMPT_TERMINAL)]:
        assert not terminal & set(table)
        for source, targets in table.items():
            assert source not in targets


# ---------------------------------------------------------------- runs
RUN_ALLOWED, RUN_FORBIDDEN = pairs(states.RUN_STATES, states.RUN_TRANSITIONS)


def _run_kwargs(target):
    return {"wait_reason": "no_worker"} if target == "waiting" else {}


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", RUN_ALLOWED, ids=ids(RUN_ALLOWED))
def test_run_allowed_transition(source, target):
    run = make_run(state=source, wait_reason="capacity" if source == "waiting" else "")
    mark = last_event_id()
    result = services.run_set_state(run_id=run.id, state=target, expected_version=run.version, **_run_kwargs(target))
    assert result.state == target
    assert result.version == run.version + 1
    assert result.wait_reason == ("no_worker" if target == "waiting" else "")
    event = assert_one_event(mark, stream=f"run:{run.id}", kind="run.state", field="state", source=source,
                             target=target, pk=run.id)
    if target == "waiting":
        assert event.data["wait_reason"] == "no_worker"
    assert (result.completed_at is not None) == (target in states.RUN_TERMINAL)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", RUN_FORBIDDEN, ids=ids(RUN_FORBIDDEN))
def test_run_forbidden_transition(source, target):
    run = make_run(state=source)
    assert_refused(lambda: services.run_set_state(run_id=run.id, state=target, **_run_kwargs(target)),
                   model=Run, pk=run.id)


@pytest.mark.django_db
def test_run_version_conflict_changes_nothing():
    run = make_run(state="running")
    assert_refused(lambda: services.run_set_state(run_id=run.id, state="paused", expected_version=run.version + 5),
                   model=Run, pk=run.id, code="version_conflict")


@pytest.mark.django_db
def test_run_keeps_its_first_start_time_when_resumed():
    run = make_run(state="planned")
    started = services.run_set_state(run_id=run.id, state="running").started_at
    services.run_set_state(run_id=run.id, state="paused")
    assert services.run_set_state(run_id=run.id, state="running").started_at == started


@pytest.mark.django_db
def test_missing_run_is_not_found():
    with pytest.raises(ApplicationError) as refused:
        services.run_set_state(run_id=uuid.uuid4(), state="running")
    assert refused.value.code == "not_found"


# ---------------------------------------------------------------- nodes
NODE_ALLOWED, NODE_FORBIDDEN = pairs(states.NODE_STATES, states.NODE_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", NODE_ALLOWED, ids=ids(NODE_ALLOWED))
def test_node_allowed_transition(source, target):
    node = make_node(state=source)
    mark = last_event_id()
    assert services.node_set_state(node_id=node.id, state=target).state == target
    assert_one_event(mark, stream=f"run:{node.run_id}", kind="node.state", field="state", source=source,
                     target=target, pk=node.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", NODE_FORBIDDEN, ids=ids(NODE_FORBIDDEN))
def test_node_forbidden_transition(source, target):
    node = make_node(state=source)
    assert_refused(lambda: services.node_set_state(node_id=node.id, state=target), model=RunNode, pk=node.id)


# ---------------------------------------------------------------- agent tasks
TASK_ALLOWED, TASK_FORBIDDEN = pairs(states.TASK_STATES, states.TASK_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", TASK_ALLOWED, ids=ids(TASK_ALLOWED))
def test_task_allowed_transition(source, target):
    task = make_task(status=source)
    mark = last_event_id()
    assert services.task_set_status(task_id=task.id, status=target).status == target
    assert_one_event(mark, stream=f"run:{task.node.run_id}", kind="task.status", field="status", source=source,
                     target=target, pk=task.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", TASK_FORBIDDEN, ids=ids(TASK_FORBIDDEN))
def test_task_forbidden_transition(source, target):
    task = make_task(status=source)
    assert_refused(lambda: services.task_set_status(task_id=task.id, status=target), model=AgentTask, pk=task.id)


# ---------------------------------------------------------------- attempts
ATTEMPT_ALLOWED, ATTEMPT_FORBIDDEN = pairs(states.ATTEMPT_STATES, states.ATTEMPT_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", ATTEMPT_ALLOWED, ids=ids(ATTEMPT_ALLOWED))
def test_attempt_allowed_transition(source, target):
    attempt = make_attempt(state=source)
    mark = last_event_id()
    result = services.attempt_set_state(attempt_id=attempt.id, state=target)
    assert result.state == target
    assert (result.ended_at is not None) == (target in states.ATTEMPT_TERMINAL)
    assert_one_event(mark, stream=f"run:{attempt.task.node.run_id}", kind="attempt.state", field="state",
                     source=source, target=target, pk=attempt.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", ATTEMPT_FORBIDDEN, ids=ids(ATTEMPT_FORBIDDEN))
def test_attempt_forbidden_transition(source, target):
    attempt = make_attempt(state=source)
    assert_refused(lambda: services.attempt_set_state(attempt_id=attempt.id, state=target),
                   model=Attempt, pk=attempt.id)


@pytest.mark.django_db
def test_attempt_keeps_its_first_start_time_after_waiting():
    attempt = make_attempt(state="preparing")
    started = services.attempt_set_state(attempt_id=attempt.id, state="running").started_at
    services.attempt_set_state(attempt_id=attempt.id, state="waiting")
    assert services.attempt_set_state(attempt_id=attempt.id, state="running").started_at == started


# ---------------------------------------------------------------- issues
ISSUE_ALLOWED, ISSUE_FORBIDDEN = pairs(states.ISSUE_STATES, states.ISSUE_TRANSITIONS)


def _issue(source, target):
    """An issue in ``source``; a blocked one remembers the state the test wants to return to."""
    before = ""
    if source == "blocked":
        before = target if target in states.ISSUE_TRANSITIONS["blocked"] - {"cancelled"} else "in_progress"
    return make_issue(status=source, status_before_blocked=before)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", ISSUE_ALLOWED, ids=ids(ISSUE_ALLOWED))
def test_issue_allowed_transition(source, target):
    issue = _issue(source, target)
    mark = last_event_id()
    result = services.issue_set_status(issue_id=issue.id, status=target, expected_version=issue.version)
    assert result.status == target
    assert result.version == issue.version + 1
    assert result.status_before_blocked == (source if target == "blocked" else "" if source == "blocked"
                                            and target != "cancelled" else issue.status_before_blocked)
    assert_one_event(mark, stream=f"issue:{issue.id}", kind="issue.status", field="status", source=source,
                     target=target, pk=issue.id)


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", ISSUE_FORBIDDEN, ids=ids(ISSUE_FORBIDDEN))
def test_issue_forbidden_transition(source, target):
    issue = _issue(source, target)
    assert_refused(lambda: services.issue_set_status(issue_id=issue.id, status=target), model=Issue, pk=issue.id)


@pytest.mark.django_db
@pytest.mark.parametrize("previous", ["backlog", "todo", "in_progress", "in_review"])
def test_blocked_returns_only_to_the_previous_state(previous):
    issue = make_issue(status=previous)
    blocked = services.issue_set_status(issue_id=issue.id, status="blocked")
    assert (blocked.status, blocked.status_before_blocked) == ("blocked", previous)
    for other in sorted(states.ISSUE_TRANSITIONS["blocked"] - {previous, "cancelled"}):
        error = assert_refused(lambda: services.issue_set_status(issue_id=issue.id, status=other),
                               model=Issue, pk=issue.id)
        assert error.detail["allowed"] == [previous, "cancelled"]
    back = services.issue_set_status(issue_id=issue.id, status=previous)
    assert (back.status, back.status_before_blocked) == (previous, "")


@pytest.mark.django_db
def test_blocked_issue_may_always_be_cancelled():
    issue = make_issue(status="todo")
    services.issue_set_status(issue_id=issue.id, status="blocked")
    assert services.issue_set_status(issue_id=issue.id, status="cancelled").status == "cancelled"


@pytest.mark.django_db
def test_issue_version_conflict_changes_nothing():
    issue = make_issue(status="in_review")
    assert_refused(lambda: services.issue_set_status(issue_id=issue.id, status="done", expected_version=99),
                   model=Issue, pk=issue.id, code="version_conflict")


# ---------------------------------------------------------------- approvals
APPROVAL_ALLOWED, APPROVAL_FORBIDDEN = pairs(states.APPROVAL_STATES, states.APPROVAL_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("on_node", [True, False], ids=["run-node", "standalone"])
@pytest.mark.parametrize("source,target", APPROVAL_ALLOWED, ids=ids(APPROVAL_ALLOWED))
def test_approval_allowed_transition(source, target, on_node):
    node = make_node(type="approval", state="waiting") if on_node else None
    approval = make_approval(node=node, status=source)
    decider = make_user()
    mark = last_event_id()
    result = services.approval_set_status(approval_id=approval.id, status=target, actor=decider,
                                          expected_version=approval.version, reason="looks right")
    assert (result.status, result.decided_by, result.reason) == (target, decider, "looks right")
    assert result.decided_at is not None
    assert result.version == approval.version + 1
    stream = f"run:{node.run_id}" if on_node else f"approval:{approval.id}"
    event = assert_one_event(mark, stream=stream, kind="approval.status", field="status", source=source,
                             target=target, pk=approval.id)
    assert event.actor == decider.username


@pytest.mark.django_db
@pytest.mark.parametrize("source,target", APPROVAL_FORBIDDEN, ids=ids(APPROVAL_FORBIDDEN))
def test_approval_forbidden_transition(source, target):
    approval = make_approval(node=make_node(type="approval"), status=source)
    assert_refused(lambda: services.approval_set_status(approval_id=approval.id, status=target),
                   model=Approval, pk=approval.id)


@pytest.mark.django_db
def test_approval_version_conflict_changes_nothing():
    approval = make_approval(node=make_node(type="approval"))
    assert_refused(lambda: services.approval_set_status(approval_id=approval.id, status="approved",
                                                        expected_version=approval.version + 1),
                   model=Approval, pk=approval.id, code="version_conflict")


# ---------------------------------------------------------------- expected_version under races (PostgreSQL)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_actions_with_the_same_expected_version_cannot_both_apply():
    # pause (running→paused) and cancel (paused→cancelling is allowed too) both read version 1:
    # only the first may act; the second saw a state that no longer holds.
    issue = make_issue()
    for _ in range(20):
        run = make_run(issue=issue, state="running")
        mark = last_event_id()
        outcomes = run_together(
            lambda: services.run_set_state(run_id=run.id, state="paused", expected_version=run.version),
            lambda: services.run_set_state(run_id=run.id, state="cancelling", expected_version=run.version),
        )
        assert sorted(outcomes) == ["ok", "version_conflict"], outcomes
        stored = Run.objects.get(pk=run.id)
        assert stored.version == run.version + 1
        assert stored.state == ("paused" if outcomes[0] == "ok" else "cancelling")
        assert [e.data["state"] for e in events_since(mark)] == [stored.state]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_issue_decisions_with_the_same_expected_version_cannot_both_apply():
    for _ in range(20):
        issue = make_issue(status="in_progress")
        outcomes = run_together(
            lambda: services.issue_set_status(issue_id=issue.id, status="blocked", expected_version=issue.version),
            lambda: services.issue_set_status(issue_id=issue.id, status="cancelled", expected_version=issue.version),
        )
        assert sorted(outcomes) == ["ok", "version_conflict"], outcomes
        assert Issue.objects.get(pk=issue.id).version == issue.version + 1
