"""Writers of executions state (SPEC §3.2). Every state change goes through ``transition``."""

from __future__ import annotations

import hashlib

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Max, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from chorus_site.audit import actor_name
from chorus_site.errors import ApplicationError
from chorus_site.events import event_append
from chorus_site.transitions import transition

from . import states
from .models import AgentTask, Approval, Artifact, Attempt, Comment, Issue, Run, RunNode


def run_lock(run_id) -> None:
    """Take the run's row lock (FOR NO KEY UPDATE), its parent runs' first; call inside the transaction.

    Every transaction that changes a run's rows or appends to its stream takes this before anything
    else of the run (the lock order in chorus_site/transitions.py), so the tick, retries, the agents'
    talk-back and operator actions on one run are serialised and cannot deadlock.  Taking it again in
    the same transaction costs a query and waits for nothing.
    """
    chain = [run_id]
    while len(chain) < 20:  # runs nest a few levels at most; a cycle cannot be stored, but never loop
        parent = Run.objects.filter(pk=chain[-1]).values_list("parent_run_id", flat=True).first()
        if parent is None or parent in chain:
            break
        chain.append(parent)
    for pk in reversed(chain):
        Run.objects.select_for_update(no_key=True).filter(pk=pk).values("pk").first()


_RUN_OF = {
    Run: "id",
    RunNode: "run_id",
    AgentTask: "node__run_id",
    Attempt: "task__node__run_id",
    Approval: "node__run_id",
}


def _run_id_of(model, pk):
    try:
        run_id = model.objects.filter(pk=pk).values_list(_RUN_OF[model], flat=True).first()
    except (ValueError, TypeError, ValidationError):
        run_id = None
    if run_id is None:
        raise ApplicationError("not_found", f"{model._meta.verbose_name} {pk} does not exist")
    return run_id


def _lock_run_of(model, pk) -> str:
    """Lock the run that ``model(pk)`` belongs to (run lock first); returns the run's stream."""
    run_id = _run_id_of(model, pk)
    run_lock(run_id)
    return f"run:{run_id}"


def _check_version(model, pk, expected_version):
    """Call inside the transaction of the change: the row stays locked until it commits, so two
    callers holding the same version cannot both act (the second sees the new version)."""
    if expected_version is None:
        return
    current = model.objects.select_for_update(no_key=True).filter(pk=pk).values_list("version", flat=True).first()
    if current is not None and current != expected_version:
        raise ApplicationError("version_conflict", f"{model._meta.verbose_name} changed meanwhile",
                               {"expected_version": expected_version, "current_version": current})


def run_set_state(*, run_id, state: str, actor=None, expected_version: int | None = None, **updates) -> Run:
    now = timezone.now()
    if state == "running":
        # Resumed (from paused or waiting) a run keeps the time it first started.
        updates.setdefault("started_at", Coalesce(F("started_at"), Value(now)))
    if state in states.RUN_TERMINAL:
        updates.setdefault("completed_at", now)
    if state not in {"waiting"}:
        updates.setdefault("wait_reason", "")
    updates["version"] = F("version") + 1
    with transaction.atomic():
        run_lock(run_id)
        _check_version(Run, run_id, expected_version)
        return transition(
            model=Run, pk=run_id, field="state", table=states.RUN_TRANSITIONS, to=state, stream=f"run:{run_id}",
            kind="run.state", actor=actor_name(actor), updates=updates,
            data={"wait_reason": updates.get("wait_reason", "")} if state == "waiting" else None,
        )


def node_set_state(*, node_id, state: str, actor=None, **updates) -> RunNode:
    with transaction.atomic():
        return transition(
            model=RunNode, pk=node_id, field="state", table=states.NODE_TRANSITIONS, to=state,
            stream=_lock_run_of(RunNode, node_id), kind="node.state", actor=actor_name(actor), updates=updates,
        )


def task_set_status(*, task_id, status: str, actor=None, **updates) -> AgentTask:
    with transaction.atomic():
        return transition(
            model=AgentTask, pk=task_id, field="status", table=states.TASK_TRANSITIONS, to=status,
            stream=_lock_run_of(AgentTask, task_id), kind="task.status", actor=actor_name(actor), updates=updates,
        )


def attempt_set_state(*, attempt_id, state: str, actor=None, **updates) -> Attempt:
    now = timezone.now()
    if state == "running":
        updates.setdefault("started_at", Coalesce(F("started_at"), Value(now)))
    if state in states.ATTEMPT_TERMINAL:
        updates.setdefault("ended_at", now)
    with transaction.atomic():
        return transition(
            model=Attempt, pk=attempt_id, field="state", table=states.ATTEMPT_TRANSITIONS, to=state,
            stream=_lock_run_of(Attempt, attempt_id), kind="attempt.state", actor=actor_name(actor),
            updates=updates,
        )


def attempt_record_outcome(*, attempt_id, intent: str, ref: str | None = None, summary: str | None = None) -> dict:
    """An agent's outcome intent (§6.5); the engine decides with it when the attempt's turn ends.
    ``waiting`` needs a real dependency: the id of an existing issue or run."""
    if intent not in states.OUTCOMES:
        raise ApplicationError("bad_request", f"intent must be one of {states.OUTCOMES}")
    if intent == "waiting" and not (ref and _work_exists(ref)):
        raise ApplicationError("bad_request", "a waiting outcome needs ref: the id of an existing issue or run")
    with transaction.atomic():
        stream = _lock_run_of(Attempt, attempt_id)  # before the attempt's row: the tick's order
        attempt = Attempt.objects.select_for_update(no_key=True).filter(pk=attempt_id).first()
        if attempt is None:
            raise ApplicationError("not_found", "not found")
        if attempt.state in states.ATTEMPT_TERMINAL:
            raise ApplicationError("invalid_transition", f"the attempt is already {attempt.state}")
        outcome = {"intent": intent, "summary": (summary or "")[:2000], "waiting_on": ref}
        Attempt.objects.filter(pk=attempt.pk).update(outcome=outcome)
        event_append(stream=stream, kind="attempt.outcome", data={"id": str(attempt.pk), **outcome})
    return outcome


def _work_exists(ref: str) -> bool:
    import uuid

    try:
        uuid.UUID(str(ref))
    except ValueError:
        return False
    return Issue.objects.filter(pk=ref).exists() or Run.objects.filter(pk=ref).exists()


def issue_set_status(*, issue_id, status: str, actor=None, expected_version: int | None = None) -> Issue:
    """Issue workflow; ``blocked`` remembers where it came from and may only return there."""
    with transaction.atomic():
        _check_version(Issue, issue_id, expected_version)
        issue = Issue.objects.select_for_update(no_key=True).filter(pk=issue_id).first()
        if issue is None:
            raise ApplicationError("not_found", f"issue {issue_id} does not exist")
        updates = {"version": F("version") + 1}
        expected_from = None
        if status == "blocked":
            updates["status_before_blocked"] = issue.status
        elif issue.status == "blocked" and status != "cancelled":
            if status != issue.status_before_blocked:
                raise ApplicationError(
                    "invalid_transition", f"a blocked issue returns to {issue.status_before_blocked}, not {status}",
                    {"from": "blocked", "to": status, "allowed": [issue.status_before_blocked, "cancelled"]},
                )
            updates["status_before_blocked"] = ""
        return transition(
            model=Issue, pk=issue_id, field="status", table=states.ISSUE_TRANSITIONS, to=status,
            stream=f"issue:{issue_id}", kind="issue.status", actor=actor_name(actor), updates=updates,
            expected_from=expected_from,
        )


def approval_set_status(*, approval_id, status: str, actor=None, expected_version: int | None = None,
                        reason: str = "") -> Approval:
    node_run = Approval.objects.filter(pk=approval_id).values_list("node__run_id", flat=True).first()
    stream = f"run:{node_run}" if node_run else f"approval:{approval_id}"
    with transaction.atomic():
        if node_run:
            run_lock(node_run)
        _check_version(Approval, approval_id, expected_version)
        return transition(
            model=Approval, pk=approval_id, field="status", table=states.APPROVAL_TRANSITIONS, to=status,
            stream=stream, kind="approval.status", actor=actor_name(actor),
            updates={"version": F("version") + 1, "decided_at": timezone.now(), "reason": reason,
                     "decided_by": actor if getattr(actor, "pk", None) else None},
        )


# ---------------------------------------------------------------- creation
def issue_create(*, title: str, body: str = "", acceptance_criteria: str = "", completion_policy: str = "review",
                 actor=None) -> Issue:
    if completion_policy not in states.COMPLETION_POLICIES:
        raise ApplicationError("bad_request", f"unknown completion policy {completion_policy!r}",
                               {"allowed": states.COMPLETION_POLICIES})
    with transaction.atomic():
        issue = Issue.objects.create(title=title, body=body, acceptance_criteria=acceptance_criteria,
                                     completion_policy=completion_policy)
        event_append(stream=f"issue:{issue.id}", kind="issue.created", actor=actor_name(actor),
                     data={"id": str(issue.id), "title": title})
    return issue


def comment_add(*, issue_id, body: str, author: str, type: str = "comment", source_task_id=None,
                source_attempt_id=None) -> Comment:
    if type not in states.COMMENT_TYPES:
        raise ApplicationError("bad_request", f"unknown comment type {type!r}", {"allowed": states.COMMENT_TYPES})
    with transaction.atomic():
        if source_attempt_id or source_task_id:
            # An agent's comment: its run's lock first, as the tick takes it (lock order).
            run_lock(_run_id_of(Attempt, source_attempt_id) if source_attempt_id else
                     _run_id_of(AgentTask, source_task_id))
        comment = Comment.objects.create(issue_id=issue_id, body=body, author=author, type=type,
                                         source_task_id=source_task_id, source_attempt_id=source_attempt_id)
        event_append(stream=f"issue:{issue_id}", kind="comment.added",
                     data={"id": str(comment.id), "type": type, "author": author})
    return comment


def artifact_add(*, issue_id, kind: str, name: str, content: str, run_id=None, attempt_id=None) -> Artifact:
    if kind not in states.ARTIFACT_KINDS:
        raise ApplicationError("bad_request", f"unknown artifact kind {kind!r}", {"allowed": states.ARTIFACT_KINDS})
    raw = content.encode()
    with transaction.atomic():
        if run_id or attempt_id:
            # Its run's lock first, as the tick takes it (lock order in chorus_site/transitions.py).
            run_lock(run_id or _run_id_of(Attempt, attempt_id))
            _artifact_scope_check(issue_id=issue_id, run_id=run_id, attempt_id=attempt_id)
        elif not Issue.objects.filter(pk=issue_id).exists():  # else an IntegrityError at COMMIT
            raise ApplicationError("not_found", f"issue {issue_id} does not exist")
        artifact = Artifact.objects.create(issue_id=issue_id, run_id=run_id, attempt_id=attempt_id, kind=kind,
                                           name=name, content=content, sha256=hashlib.sha256(raw).hexdigest(),
                                           size=len(raw))
        if run_id:
            event_append(stream=f"run:{run_id}", kind="artifact.added",
                         data={"id": str(artifact.id), "name": name, "kind": kind})
    return artifact


def _artifact_scope_check(*, issue_id, run_id, attempt_id) -> None:
    """An artifact's run belongs to its issue, and its attempt to that run: no cross-issue links."""
    if attempt_id:
        attempt_run = _run_id_of(Attempt, attempt_id)
        if run_id and str(attempt_run) != str(run_id):
            raise ApplicationError("bad_request", "the attempt does not belong to this run",
                                   {"attempt": str(attempt_id), "run": str(run_id)})
        run_id = attempt_run
    run_issue = Run.objects.filter(pk=run_id).values_list("issue_id", flat=True).first()
    if run_issue is None:
        raise ApplicationError("not_found", f"run {run_id} does not exist")
    if str(run_issue) != str(issue_id):
        raise ApplicationError("bad_request", "the run does not belong to this issue",
                               {"run": str(run_id), "issue": str(issue_id)})


# ---------------------------------------------------------------- tasks
def task_create(*, node_id, retry_of_id=None, leader: bool = False, actor=None) -> AgentTask:
    """A new task of a node with the next ordinal; the run's row lock makes the choice safe."""
    with transaction.atomic():
        run_id = _run_id_of(RunNode, node_id)
        run_lock(run_id)
        ordinal = (AgentTask.objects.filter(node_id=node_id).aggregate(m=Max("ordinal"))["m"] or 0) + 1
        task = AgentTask.objects.create(node_id=node_id, ordinal=ordinal, retry_of_id=retry_of_id, leader=leader)
        event_append(stream=f"run:{run_id}", kind="task.created", actor=actor_name(actor),
                     data={"id": str(task.pk), "node": str(node_id), "ordinal": ordinal,
                           "retry_of": str(retry_of_id) if retry_of_id else None})
    return task


def task_retry(*, task_id, actor=None) -> tuple[AgentTask, bool]:
    """A new task for a finished task's node (the finished one stays as it was): ``(task, created)``.

    Decided under the run's row lock: when the node already has an active task (another operator's
    retry, or the engine's own policy retry, got there first) no second one is made; that task is
    returned with ``created`` False.
    """
    with transaction.atomic():
        run_lock(_run_id_of(AgentTask, task_id))
        task = AgentTask.objects.select_related("node__run").get(pk=task_id)
        node, run = task.node, task.node.run
        active = node.tasks.exclude(status__in=states.TASK_TERMINAL).order_by("-ordinal").first()
        if active is not None and active.pk == task.pk:
            raise ApplicationError("invalid_transition", "the task is still active: cancel it first")
        if active is not None:
            return active, False
        if node.state in states.NODE_TERMINAL or run.state in states.RUN_TERMINAL:
            raise ApplicationError("invalid_transition", "the node has finished: rerun the run instead",
                                   {"node": node.state, "run": run.state})
        return task_create(node_id=node.pk, retry_of_id=task.pk, leader=task.leader, actor=actor), True
