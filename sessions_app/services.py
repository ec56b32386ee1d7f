"""Writers of sessions_app state (SPEC §3.1). Every status change goes through ``transition``."""

from __future__ import annotations

import hashlib
import posixpath
import re
import secrets

from django.db import IntegrityError, transaction
from django.db.models import F, Max, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from chorus_site.audit import actor_name, audit_record
from chorus_site.errors import ApplicationError
from chorus_site.events import event_append
from chorus_site.redaction import redact
from chorus_site.transitions import transition

from . import metrics, states
from .listeners import turn_reopen_refusal, turn_status_changed
from .models import Connection, ControlCommand, Session, TranscriptMessage, Turn

WAKE_ERROR_DETAILS_MAX = 64 * 1024
# CSI (parameters 0x30-0x3F, intermediates, final), OSC ended by BEL or ST, and the other
# two- and three-byte escapes (charset designation, keypad modes, ...); a stray ESC goes too.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[ -/]*[0-~]|\x1b")

GENERIC_WAKE_SUMMARY = "The agent stopped without leaving a diagnostic message."
WAKE_ERROR_FIELDS = {"kind", "summary", "source", "details", "exit_code", "signal"}


# ---------------------------------------------------------------- connections
def connection_key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def connection_register(
    *, name: str, backend: str, cwds: list[str], host: str = "", max_concurrency: int = 4,
    sigint_timeout_s: int = 10, auto_resume_crashed: bool = False, actor=None, stall_threshold_s: int | None = None,
) -> tuple[Connection, str]:
    """Register a daemon's connection; the key is returned once and stored hashed."""
    if backend not in states.BACKENDS:
        raise ApplicationError("bad_request", f"unknown backend {backend!r}", {"allowed": states.BACKENDS})
    if not cwds or not all(isinstance(c, str) and c.startswith("/") for c in cwds):
        raise ApplicationError("bad_request", "cwds must be a non-empty list of absolute paths")
    prefix = secrets.token_hex(4)
    key = f"chk_{prefix}_{secrets.token_urlsafe(32)}"
    with transaction.atomic():
        connection = Connection.objects.create(
            name=name, backend=backend, cwds=cwds, host=host, max_concurrency=max_concurrency,
            sigint_timeout_s=sigint_timeout_s, key_prefix=prefix, key_hash=connection_key_hash(key),
            auto_resume_crashed=auto_resume_crashed, stall_threshold_s=stall_threshold_s or None,
        )
        event_append(stream=f"connection:{connection.id}", kind="connection.registered",
                     data={"id": str(connection.id), "name": name, "backend": backend}, actor=actor_name(actor))
    return connection, key


def connection_set_stall_threshold(*, connection_id, stall_threshold_s: int | None, actor=None,
                                   client: str = "system") -> Connection:
    """Set (or clear: None) the connection's stall threshold in seconds (sessions_app/stalls.py); audited."""
    if stall_threshold_s is not None and stall_threshold_s < 1:
        raise ApplicationError("bad_request", "a stall threshold is at least 1 second")
    with transaction.atomic():
        if Connection.objects.filter(pk=connection_id).update(stall_threshold_s=stall_threshold_s) != 1:
            raise ApplicationError("not_found", f"connection {connection_id} does not exist")
        event_append(stream=f"connection:{connection_id}", kind="connection.stall_threshold",
                     data={"id": str(connection_id), "stall_threshold_s": stall_threshold_s}, actor=actor_name(actor))
        audit_record(actor=actor or "system", action="connection.stall_threshold", target=f"connection:{connection_id}",
                     outcome=f"stall_threshold_s={stall_threshold_s}", client=client)
    return Connection.objects.get(pk=connection_id)


def connection_rotate_key(*, connection_id, cwds: list[str] | None = None, actor=None) -> str:
    """Issue a new key (the old one stops working at once); returns it, shown once."""
    prefix = secrets.token_hex(4)
    key = f"chk_{prefix}_{secrets.token_urlsafe(32)}"
    updates = {"key_prefix": prefix, "key_hash": connection_key_hash(key)}
    if cwds is not None:
        updates["cwds"] = cwds
    with transaction.atomic():
        if Connection.objects.filter(pk=connection_id).update(**updates) != 1:
            raise ApplicationError("not_found", f"connection {connection_id} does not exist")
        event_append(stream=f"connection:{connection_id}", kind="connection.key_rotated",
                     data={"id": str(connection_id)}, actor=actor_name(actor))
    return key


def connection_set_status(*, connection_id, status: str, actor=None, **updates) -> Connection:
    return transition(
        model=Connection, pk=connection_id, field="status", table=states.CONNECTION_TRANSITIONS, to=status,
        stream=f"connection:{connection_id}", kind="connection.status", actor=actor_name(actor), updates=updates,
    )


# ---------------------------------------------------------------- sessions
def cwd_allowed(connection: Connection, cwd: str) -> bool:
    """Inside one of the connection's roots, after ``..`` and ``.`` are resolved (``<root>/../etc`` is not)."""
    if not cwd.startswith("/"):
        return False
    cwd = posixpath.normpath(cwd).rstrip("/") or "/"
    for root in connection.cwds:
        root = posixpath.normpath(root).rstrip("/") or "/"
        if cwd == root or cwd.startswith(root + "/") or root == "/":
            return True
    return False


def session_create(
    *, connection: Connection, cwd: str, idea_key: str, title: str = "", actor=None, handoff_from=None,
    backend_session_id: str | None = None, provider: str = "", model: str = "",
) -> Session:
    if not cwd_allowed(connection, cwd):
        raise ApplicationError(
            "bad_request", f"cwd {cwd!r} is not inside the connection's allowed directories",
            {"cwd": cwd, "allowed": connection.cwds},
        )
    with transaction.atomic():
        if Session.objects.filter(idea_key=idea_key, status=states.SESSION_ACTIVE).exists():
            raise ApplicationError("conflict", f"an active session already exists for idea key {idea_key!r}",
                                   {"idea_key": idea_key})
        try:
            with transaction.atomic():
                session = Session.objects.create(
                    connection=connection, cwd=cwd, idea_key=idea_key, title=title or idea_key,
                    backend=connection.backend, created_by=actor if getattr(actor, "pk", None) else None,
                    handoff_from=handoff_from, backend_session_id=backend_session_id, provider=provider,
                    model=model,
                )
        except IntegrityError:
            # A concurrent start of the same idea won between the check above and this insert.
            if not Session.objects.filter(idea_key=idea_key, status=states.SESSION_ACTIVE).exists():
                raise
            raise ApplicationError("conflict", f"an active session already exists for idea key {idea_key!r}",
                                   {"idea_key": idea_key}) from None
        event_append(stream=session.stream, kind="session.created", actor=actor_name(actor),
                     data={"id": str(session.id), "connection": str(connection.id), "cwd": cwd, "idea_key": idea_key})
    return session


def session_set_status(*, session_id, status: str, actor=None) -> Session:
    return transition(
        model=Session, pk=session_id, field="status", table=states.SESSION_TRANSITIONS, to=status,
        stream=f"session:{session_id}", kind="session.status", actor=actor_name(actor),
    )


def session_add_usage(*, session_id, usage: dict) -> None:
    Session.objects.filter(pk=session_id).update(
        tokens_input=F("tokens_input") + int(usage.get("input", 0) or 0),
        tokens_output=F("tokens_output") + int(usage.get("output", 0) or 0),
        tokens_cache_read=F("tokens_cache_read") + int(usage.get("cache_read", 0) or 0),
        tokens_cache_write=F("tokens_cache_write") + int(usage.get("cache_write", 0) or 0),
    )


def transcript_append(*, session_id, role: str, text: str, turn_id=None) -> TranscriptMessage:
    """Append a message and keep only the newest WINDOW messages of the session."""
    message = TranscriptMessage.objects.create(session_id=session_id, role=role, text=redact(text), turn_id=turn_id)
    cutoff = (TranscriptMessage.objects.filter(session_id=session_id).order_by("-id")
              .values_list("id", flat=True)[TranscriptMessage.WINDOW:TranscriptMessage.WINDOW + 1].first())
    if cutoff is not None:
        TranscriptMessage.objects.filter(session_id=session_id, id__lte=cutoff).delete()
    return message


# ---------------------------------------------------------------- turns
def turn_create(*, session: Session, trigger: str, prompt: str, actor=None, attempt_id=None) -> Turn:
    """A new pending turn with the next seq of its session (session row locked for the choice)."""
    if trigger not in states.TRIGGERS:
        raise ApplicationError("bad_request", f"unknown trigger {trigger!r}", {"allowed": states.TRIGGERS})
    with transaction.atomic():
        Session.objects.select_for_update(no_key=True).filter(pk=session.pk).values("pk").first()
        seq = (Turn.objects.filter(session=session).aggregate(m=Max("seq"))["m"] or 0) + 1
        turn = Turn.objects.create(session=session, seq=seq, trigger=trigger, prompt=redact(prompt),
                                   attempt_id=attempt_id)
        Session.objects.filter(pk=session.pk).update(last_turn_at=timezone.now())
        event_append(stream=session.stream, kind="turn.created", actor=actor_name(actor),
                     data={"id": str(turn.id), "seq": seq, "trigger": trigger, "status": turn.status})
    return turn


def wake_error_build(
    *, kind: str, summary: str | None = None, source: str = "", details: str | None = None,
    exit_code: int | None = None, signal: str | None = None,
) -> dict:
    """Normalise a wake error: ANSI stripped, tail kept (≤64 KiB), secrets masked before storage."""
    if kind not in states.WAKE_ERROR_KINDS:
        raise ApplicationError("bad_request", f"unknown wake error kind {kind!r}", {"allowed": states.WAKE_ERROR_KINDS})
    clean = _ANSI.sub("", details or "")
    clean = redact(clean) or ""
    encoded = clean.encode()
    if len(encoded) > WAKE_ERROR_DETAILS_MAX:
        clean = encoded[-WAKE_ERROR_DETAILS_MAX:].decode("utf-8", errors="ignore")
    return {
        "summary": redact(summary) if summary else GENERIC_WAKE_SUMMARY,
        "kind": kind,
        "source": source,
        "details": clean,
        "exit_code": exit_code,
        "signal": signal,
    }


def turn_set_status(
    *, turn_id, status: str, actor=None, reason: str | None = None, wake_error: dict | None = None,
    stop_state: str | None = None, from_daemon: bool = False, data: dict | None = None, **fields,
) -> Turn:
    """Move a turn along its state machine (SPEC §3.1) with the rules attached to each status."""
    updates = dict(fields)
    now = timezone.now()
    if status == states.INTERRUPTED:
        if reason not in states.INTERRUPTED_REASONS:
            raise ApplicationError("bad_request", "an interrupted turn needs a reason",
                                   {"allowed": states.INTERRUPTED_REASONS})
        if from_daemon and reason not in states.DAEMON_REPORTABLE_REASONS:
            raise ApplicationError("bad_request", f"a daemon may not report reason {reason!r}")
        updates["interrupted_reason"] = reason
        if wake_error and reason in states.WAKE_ERROR_REASONS:
            unknown = set(wake_error) - WAKE_ERROR_FIELDS
            if unknown:
                raise ApplicationError("bad_request", "unknown wake error fields",
                                       {"unknown": sorted(unknown), "allowed": sorted(WAKE_ERROR_FIELDS)})
            # A repeated terminal report keeps the first error: the transition below refuses it.
            updates["wake_error"] = wake_error_build(**wake_error)
        elif reason in states.WAKE_ERROR_REASONS:
            updates["wake_error"] = wake_error_build(kind=_default_wake_kind(reason))
    elif reason:
        raise ApplicationError("bad_request", "only an interrupted turn has a reason")
    if status == states.RUNNING:
        # Back from requires_action the turn keeps the time it first started.
        updates.setdefault("started_at", Coalesce(F("started_at"), Value(now)))
    if status in states.TURN_TERMINAL:
        updates.setdefault("ended_at", now)
    if stop_state is not None:
        updates["stop_state"] = stop_state
    if "final_reply" in updates:
        updates["final_reply"] = redact(updates["final_reply"]) or ""
    session_id = Turn.objects.filter(pk=turn_id).values_list("session_id", flat=True).first()
    if session_id is None:
        raise ApplicationError("not_found", f"turn {turn_id} does not exist")
    event_data = {"session": str(session_id), **(data or {})}
    if status == states.INTERRUPTED:
        event_data["interrupted_reason"] = reason
    if stop_state is not None:
        event_data["stop_state"] = stop_state
    with transaction.atomic():
        # Lock order session → turn → event stream, as in turn_create: taking the session row last
        # deadlocks against a concurrent turn_create of the same session.
        Session.objects.select_for_update(no_key=True).filter(pk=session_id).values("pk").first()
        turn = transition(
            model=Turn, pk=turn_id, field="status", table=states.TURN_TRANSITIONS, to=status,
            stream=f"session:{session_id}", kind="turn.status", actor=actor_name(actor), updates=updates,
            data=event_data,
        )
        Session.objects.filter(pk=session_id).update(last_turn_at=now)
        turn_status_changed(turn_id=turn.pk, attempt_id=turn.attempt_id, status=status)
        metrics.turn_status_observed(turn.pk, status)
        metrics.stop_state_observed(turn.pk, stop_state)
    return turn


def turn_reopen_held(*, turn_id, evidence: dict) -> Turn:
    """A turn settled ``interrupted(offline)`` whose daemon still holds its process runs again.

    ``offline`` is the portal's guess (the heartbeat went stale); the daemon's word about its own
    processes wins (SPEC §11).  The only transition out of a terminal status
    (``states.TURN_RECONCILE_TRANSITIONS``), recorded as ``turn.status`` and a ``turn.reconciled``
    event with the evidence and what the settle had recorded.  Refused (409) unless the turn is
    ``interrupted(offline)``, while another turn of its session runs (never two at once), and once
    its work went on without it (``listeners.on_turn_reopen``: the engine already ended its attempt,
    perhaps with a new one doing the same work).  A refusal is ``conflict``: the caller stops the
    process instead (sessions_app.reconcile).
    """
    with transaction.atomic():
        turn = turn_lock(turn_id)  # session → turn
        if turn is None:
            raise ApplicationError("not_found", f"turn {turn_id} does not exist")
        session_id = turn.session_id
        if turn.status != states.INTERRUPTED or turn.interrupted_reason != states.REASON_OFFLINE:
            raise ApplicationError("invalid_transition", f"a turn that is {turn.status_label} is not reopened",
                                   {"status": turn.status, "interrupted_reason": turn.interrupted_reason})
        # Read under the turn's lock: the engine decides on a settled turn under the same lock, so
        # either it saw this turn running again or this sees what it decided.
        superseded = turn_reopen_refusal(turn)
        if superseded:
            raise ApplicationError("conflict", f"its work went on without it: {superseded}",
                                   {"superseded": superseded})
        other = (Turn.objects.filter(session_id=session_id, status__in=[states.RUNNING, states.REQUIRES_ACTION])
                 .exclude(pk=turn.pk).values_list("pk", flat=True).first())
        if other is None:
            # Nor over a later turn already sent to a daemon (e.g. where its session moved meanwhile):
            # that daemon may be starting it; two turns of a session never run at once.
            other = (ControlCommand.objects.filter(
                turn__session_id=session_id, turn__status=states.PENDING, action__in=["start_turn", "resume"],
                state__in=[states.CMD_PENDING, states.CMD_DELIVERED, states.CMD_ACKED])
                .values_list("turn_id", flat=True).first())
        if other is not None:
            raise ApplicationError("conflict", "another turn of this session runs; interrupt this one instead",
                                   {"running": str(other)})
        record = {**evidence, "settled": {"ended_at": turn.ended_at.isoformat() if turn.ended_at else None,
                                          "interrupt_evidence": turn.interrupt_evidence}}
        turn = transition(
            model=Turn, pk=turn.pk, field="status", table=states.TURN_RECONCILE_TRANSITIONS, to=states.RUNNING,
            stream=f"session:{session_id}", kind="turn.status", actor=actor_name(None),
            updates={"interrupted_reason": "", "ended_at": None, "interrupt_evidence": None},
            data={"session": str(session_id), "reconciled": True},
        )
        event_append(stream=f"session:{session_id}", kind="turn.reconciled", actor=actor_name(None),
                     data={"id": str(turn.pk), "session": str(session_id), "from": "interrupted(offline)",
                           "to": states.RUNNING, "evidence": record})
        Session.objects.filter(pk=session_id).update(last_turn_at=timezone.now())
        turn_status_changed(turn_id=turn.pk, attempt_id=turn.attempt_id, status=states.RUNNING)
    return turn


def _default_wake_kind(reason: str) -> str:
    return {states.REASON_INVALID_PATH: "invalid_path", states.REASON_TIMEOUT: "timeout"}.get(reason, "exited_nonzero")


def turn_set_stop_state(*, turn_id, stop_state: str, actor=None, **updates) -> Turn:
    session_id = Turn.objects.filter(pk=turn_id).values_list("session_id", flat=True).first()
    with transaction.atomic():
        # Session → turn, as every change of a turn (lock order: chorus_site/transitions.py).
        Session.objects.select_for_update(no_key=True).filter(pk=session_id).values("pk").first()
        turn = transition(
            model=Turn, pk=turn_id, field="stop_state", table=states.STOP_TRANSITIONS, to=stop_state,
            stream=f"session:{session_id}", kind="turn.stop_state", actor=actor_name(actor), updates=updates,
            data={"session": str(session_id)},
        )
        metrics.stop_state_observed(turn.pk, stop_state)
        return turn


def turn_lock(turn_id, *, related: tuple = ()) -> Turn | None:
    """Lock a turn's session row and then the turn's (lock order: chorus_site/transitions.py) and
    return the turn as it stands now, or None; for actions and reports that decide on a turn's
    state.  Call inside their transaction."""
    session_id = Turn.objects.filter(pk=turn_id).values_list("session_id", flat=True).first()
    if session_id is None:
        return None
    Session.objects.select_for_update(no_key=True).filter(pk=session_id).values("pk").first()
    return (Turn.objects.select_for_update(no_key=True, of=("self",)).select_related(*related)
            .filter(pk=turn_id).first())


# ---------------------------------------------------------------- control commands
def command_create(*, connection_id, action: str, turn_id=None, payload: dict | None = None,
                   expires_at=None) -> ControlCommand:
    if action not in states.COMMAND_ACTIONS:
        raise ApplicationError("bad_request", f"unknown command {action!r}")
    with transaction.atomic():
        command = ControlCommand.objects.create(connection_id=connection_id, action=action, turn_id=turn_id,
                                                payload=payload or {}, expires_at=expires_at)
        event_append(stream=f"connection:{connection_id}", kind="command.created",
                     data={"id": str(command.id), "action": action, "turn": str(turn_id) if turn_id else None})
    return command


def command_set_state(*, command_id, state: str, **updates) -> ControlCommand:
    connection_id = ControlCommand.objects.filter(pk=command_id).values_list("connection_id", flat=True).first()
    command = transition(
        model=ControlCommand, pk=command_id, field="state", table=states.COMMAND_TRANSITIONS, to=state,
        stream=f"connection:{connection_id}", kind="command.state", updates=updates,
    )
    metrics.command_state_observed(command.pk, state)
    return command
