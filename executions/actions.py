"""Run actions (SPEC §4.7), shared by the admin and the API; each audited, answering what it did."""

from __future__ import annotations

from django.db import transaction

from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError
from sessions_app import actions as session_actions

from . import engine, services, states
from .models import Attempt, Run


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
        return {"changed": False, "state": run.state, "version": run.version}
    with transaction.atomic():
        run = services.run_set_state(run_id=run.pk, state="running", actor=actor, expected_version=expected_version)
        _audit(actor, "run.resume", run, "running", client, reason, idempotency_key)
        engine.schedule_tick(run.pk)
    return {"changed": True, "state": run.state, "version": run.version}


def run_cancel(*, actor, run_id, expected_version=None, client="api", reason=None, idempotency_key=None) -> dict:
    """→ cancelling; every active attempt is interrupted (verified stop); cancelled when all are terminal.
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
        _audit(actor, "run.cancel", run, f"cancelling; {len(interrupted)} turn(s) interrupted", client, reason,
               idempotency_key)
        engine.schedule_tick(run.pk)
    return {"changed": True, "state": run.state, "version": run.version, "interrupted_turns": interrupted}


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
