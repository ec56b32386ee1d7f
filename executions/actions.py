"""Run actions (SPEC §4.7), shared by the admin and the API; each audited, answering what it did."""

from __future__ import annotations

from django.db import transaction

from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError
from sessions_app import actions as session_actions

from . import engine, services, states
from .models import AgentTask, Approval, Attempt, Issue, Run, RunNode


def _run(run_id) -> Run:
    run = Run.objects.filter(pk=run_id).first() if engine._is_uuid(run_id) else None
    if run is None:
        raise ApplicationError("not_found", "not found")
    return run


def _audit(actor, action, run, outcome, client, reason, key):
    audit_record(actor=actor, action=action, target=f"run:{run.pk}", outcome=outcome, client=client, reason=reason,
                 idempotency_key=key)


def run_pause(*, actor, run_id, expected_version=None, client="api", reason=None, idempotency_key=None) -> dict:
    """No new node is dispatched; attempts already running go on (pausing freezes no process)."""
    run = _run(run_id)
    if run.state == "paused":
        _audit(actor, "run.pause", run, "unchanged", client, reason, idempotency_key)
        return {"changed": False, "state": run.state, "version": run.version}
    with transaction.atomic():
        run = services.run_set_state(run_id=run.pk, state="paused", actor=actor, expected_version=expected_version)
        _audit(actor, "run.pause", run, "paused", client, reason, idempotency_key)
    return {"changed": True, "state": run.state, "version": run.version}


def run_resume(*, actor, run_id, expected_version=None, client="api", reason=None, idempotency_key=None) -> dict:
    run = _run(run_id)
    if run.state in {"running", "waiting"}:
        _audit(actor, "run.resume", run, "unchanged", client, reason, idempotency_key)
        # Nothing to change, but an operator asking means it looks stuck: a tick is a harmless nudge.
        engine.schedule_tick(run.pk)
        return {"changed": False, "state": run.state, "version": run.version}
    with transaction.atomic():
        run = services.run_set_state(run_id=run.pk, state="running", actor=actor, expected_version=expected_version)
        _audit(actor, "run.resume", run, "running", client, reason, idempotency_key)
        engine.schedule_tick(run.pk)
    return {"changed": True, "state": run.state, "version": run.version}


def run_cancel(*, actor, run_id, expected_version=None, client="api", reason=None, idempotency_key=None) -> dict:
    """→ cancelling; every active attempt is interrupted (verified stop), every subrun is cancelled the
    same way (recursively) and pending approvals are cancelled; cancelled when all are terminal.
    Nothing is rolled back and the issue is not accepted."""
    run = _run(run_id)
    if run.state in {"cancelling", "cancelled"}:
        _audit(actor, "run.cancel", run, "unchanged", client, reason, idempotency_key)
        return {"changed": False, "state": run.state, "version": run.version}
    interrupted = []
    with transaction.atomic():
        run = services.run_set_state(run_id=run.pk, state="cancelling", actor=actor, expected_version=expected_version)
        for attempt in Attempt.objects.filter(task__node__run=run).exclude(state__in=states.ATTEMPT_TERMINAL):
            services.attempt_set_state(attempt_id=attempt.pk, state="cancel_requested", actor=actor)
            if attempt.turn_id:
                try:
                    session_actions.turn_interrupt(actor=actor, turn_id=attempt.turn_id, client=client,
                                                   reason=reason or "run cancelled")
                    interrupted.append(str(attempt.turn_id))
                except ApplicationError:
                    pass  # the turn already ended: the tick settles the attempt
        approvals = [approval.pk for approval in Approval.objects.filter(node__run=run, status="pending")]
        for approval_id in approvals:
            services.approval_set_status(approval_id=approval_id, status="cancelled", actor=actor,
                                         reason=reason or "run cancelled")
        subruns = []
        for child in Run.objects.filter(parent_run=run).exclude(state__in=states.RUN_TERMINAL).order_by("id"):
            answer = run_cancel(actor=actor, run_id=child.pk, client=client,
                                reason=reason or f"parent run {run.pk} cancelled")
            subruns.append(str(child.pk))
            interrupted += answer.get("interrupted_turns", [])
        _audit(actor, "run.cancel", run, f"cancelling; {len(interrupted)} turn(s) interrupted, {len(approvals)} "
               f"approval(s) and {len(subruns)} subrun(s) cancelled", client, reason, idempotency_key)
        engine.schedule_tick(run.pk)
    return {"changed": True, "state": run.state, "version": run.version, "interrupted_turns": interrupted,
            "cancelled_subruns": subruns, "cancelled_approvals": [str(a) for a in approvals]}


def run_rerun(*, actor, run_id, input=None, client="api", reason=None, idempotency_key=None) -> dict:
    """A new run with rerun_of: same issue, mode, revision and input unless overridden."""
    run = _run(run_id)
    if run.state not in states.RUN_TERMINAL:
        raise ApplicationError("invalid_transition", f"only a finished run can be rerun (this one is {run.state})")
    new = engine.run_start(issue_id=run.issue_id, mode=run.mode, input=input if input is not None else run.input,
                           workflow_revision_id=run.workflow_revision_id, target=run.target, policy=run.policy,
                           actor=actor, rerun_of=run, trigger="rerun", client=client,
                           idempotency_key=idempotency_key)
    _audit(actor, "run.rerun", run, f"rerun as {new.pk}", client, reason, idempotency_key)
    return {"changed": True, "run": str(new.pk), "rerun_of": str(run.pk), "state": new.state}


# ---------------------------------------------------------------- signals, approvals, review, tasks
def run_signal(*, actor, run_id, name: str, client="api", reason=None, idempotency_key=None) -> dict:
    """Deliver a named signal to the run's nodes waiting for it."""
    run = _run(run_id)
    if run.state in states.RUN_TERMINAL:
        raise ApplicationError("invalid_transition", f"the run is {run.state}")
    delivered = []
    with transaction.atomic():
        for node in RunNode.objects.filter(run=run, type="signal", state="waiting"):
            if node.wait_detail.get("signal") == name:
                services.node_set_state(node_id=node.pk, state="succeeded", actor=actor)
                delivered.append(node.key)
        _audit(actor, "run.signal", run, f"signal {name} to {len(delivered)} node(s)", client, reason, idempotency_key)
        if delivered:
            engine.schedule_tick(run.pk)
    return {"changed": bool(delivered), "signal": name, "nodes": delivered}


def approval_decide(*, actor, approval_id, decision: str, expected_version=None, client="api", reason=None,
                    idempotency_key=None) -> dict:
    if decision not in {"approved", "rejected"}:
        raise ApplicationError("bad_request", "decision is approved or rejected")
    approval = Approval.objects.select_related("node").filter(pk=approval_id).first()
    if approval is None:
        raise ApplicationError("not_found", "not found")
    designated = approval.approver_user_id or approval.approver_group_id
    if designated and not (approval.approver_user_id == getattr(actor, "pk", None)
                           or actor.groups.filter(pk=approval.approver_group_id).exists()):
        raise ApplicationError("forbidden", "this approval is for a designated approver")
    if approval.status == decision:
        return {"changed": False, "status": approval.status, "version": approval.version}
    with transaction.atomic():
        approval = services.approval_set_status(approval_id=approval.pk, status=decision, actor=actor,
                                                expected_version=expected_version, reason=reason or "")
        node = approval.node
        if node is not None and node.state == "waiting":
            services.node_set_state(node_id=node.pk, state="succeeded" if decision == "approved" else "failed",
                                    actor=actor, failure_message="" if decision == "approved" else
                                    f"rejected: {reason or 'no reason given'}")
            engine.schedule_tick(node.run_id)
        audit_record(actor=actor, action="approval.decide", target=f"approval:{approval.pk}", outcome=decision,
                     client=client, reason=reason, idempotency_key=idempotency_key)
    return {"changed": True, "status": approval.status, "version": approval.version}


def issue_review(*, actor, issue_id, accept: bool, expected_version=None, client="api", reason=None,
                 idempotency_key=None) -> dict:
    """Accept (in_review → done) or reject (→ in_progress, starting no execution)."""
    issue = Issue.objects.filter(pk=issue_id).first()
    if issue is None:
        raise ApplicationError("not_found", "not found")
    target = "done" if accept else "in_progress"
    if issue.status != "in_review":
        if issue.status == target and accept:
            return {"changed": False, "status": issue.status, "version": issue.version}
        raise ApplicationError("invalid_transition", f"only an issue in review can be {'accepted' if accept else 'rejected'}",
                               {"status": issue.status})
    with transaction.atomic():
        issue = services.issue_set_status(issue_id=issue.pk, status=target, actor=actor,
                                          expected_version=expected_version)
        if reason:
            services.comment_add(issue_id=issue.pk, body=reason, author=getattr(actor, "username", "system"),
                                 type="status")
        audit_record(actor=actor, action="issue.accept" if accept else "issue.reject", target=f"issue:{issue.pk}",
                     outcome=issue.status, client=client, reason=reason, idempotency_key=idempotency_key)
    return {"changed": True, "status": issue.status, "version": issue.version}


def issue_reopen(*, actor, issue_id, expected_version=None, client="api", reason=None, idempotency_key=None) -> dict:
    """done → in_progress (§3.2), so that its work can go on (e.g. a rerun of its succeeded run)."""
    issue = Issue.objects.filter(pk=issue_id).first() if engine._is_uuid(issue_id) else None
    if issue is None:
        raise ApplicationError("not_found", "not found")
    target = f"issue:{issue.pk}"
    if issue.status == "in_progress":
        audit_record(actor=actor, action="issue.reopen", target=target, outcome="unchanged", client=client,
                     reason=reason, idempotency_key=idempotency_key)
        return {"changed": False, "status": issue.status, "version": issue.version}
    if issue.status != "done":
        raise ApplicationError("invalid_transition", f"only a done issue can be reopened (this one is {issue.status})",
                               {"status": issue.status})
    with transaction.atomic():
        issue = services.issue_set_status(issue_id=issue.pk, status="in_progress", actor=actor,
                                          expected_version=expected_version)
        if reason:
            services.comment_add(issue_id=issue.pk, body=reason, author=getattr(actor, "username", "system"),
                                 type="status")
        audit_record(actor=actor, action="issue.reopen", target=target, outcome=issue.status, client=client,
                     reason=reason, idempotency_key=idempotency_key)
    return {"changed": True, "status": issue.status, "version": issue.version}


def task_retry(*, actor, task_id, client="api", reason=None, idempotency_key=None) -> dict:
    """A new task for the node (the finished task stays as it was); ``changed: false`` when the node
    already has an active task (a concurrent retry, or the engine's own, made it)."""
    with transaction.atomic():
        new, created = services.task_retry(task_id=task_id, actor=actor)
        if not created:
            audit_record(actor=actor, action="task.retry", target=f"task:{task_id}",
                         outcome=f"unchanged: task {new.pk} is already active", client=client, reason=reason,
                         idempotency_key=idempotency_key)
            return {"changed": False, "task": str(new.pk), "status": new.status}
        audit_record(actor=actor, action="task.retry", target=f"task:{task_id}", outcome=f"new task {new.pk}",
                     client=client, reason=reason, idempotency_key=idempotency_key)
        engine.schedule_tick(new.node.run_id)
    return {"changed": True, "task": str(new.pk), "retry_of": str(task_id)}


def task_cancel(*, actor, task_id, client="api", reason=None, idempotency_key=None) -> dict:
    task = AgentTask.objects.select_related("node__run").filter(pk=task_id).first()
    if task is None:
        raise ApplicationError("not_found", "not found")
    if task.status == "cancelled":
        return {"changed": False, "status": task.status}
    if task.status in states.TASK_TERMINAL:
        raise ApplicationError("invalid_transition", f"the task is {task.status}")
    with transaction.atomic():
        for attempt in task.attempts.exclude(state__in=states.ATTEMPT_TERMINAL):
            services.attempt_set_state(attempt_id=attempt.pk, state="cancel_requested", actor=actor)
            if attempt.turn_id:
                try:
                    session_actions.turn_interrupt(actor=actor, turn_id=attempt.turn_id, client=client,
                                                   reason=reason or "task cancelled")
                except ApplicationError:
                    pass
        task = services.task_set_status(task_id=task.pk, status="cancelled", actor=actor)
        audit_record(actor=actor, action="task.cancel", target=f"task:{task.pk}", outcome="cancelled", client=client,
                     reason=reason, idempotency_key=idempotency_key)
        engine.schedule_tick(task.node.run_id)
    return {"changed": True, "status": task.status}
