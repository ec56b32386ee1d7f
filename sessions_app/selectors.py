"""Reads of sessions_app: querysets with their joins, permission-aware serialisation."""

from __future__ import annotations

import shlex
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from chorus_site.errors import ApplicationError
from chorus_site.permissions import can_view_diagnostics
from chorus_site.redaction import redact

from . import states
from .models import Connection, Session, TranscriptMessage, Turn

def heartbeat_timeout() -> timedelta:
    """The one staleness threshold (CHORUS_HEARTBEAT_TIMEOUT_S): not live here, swept by the bridge."""
    return timedelta(seconds=settings.CHORUS_HEARTBEAT_TIMEOUT_S)



def connections_qs() -> QuerySet:
    return Connection.objects.all()


def sessions_qs() -> QuerySet:
    # handoff_to is the reverse one-to-one: joined like the others, not a second query per page.
    return Session.objects.select_related("connection", "created_by", "handoff_from", "handoff_to")


# What session_out reads: a list page loads these columns only, not every column of the session,
# its connection, its creator and both hand-off sessions (issue 9: 16 ms instead of 38 ms for a
# 50-row page, most of it building model instances nobody reads).
SESSION_LIST_FIELDS = ("id", "idea_key", "title", "connection_id", "connection__name", "cwd", "backend",
                       "backend_session_id", "provider", "model", "status", "last_turn_at", "tokens_input",
                       "tokens_output", "tokens_cache_read", "tokens_cache_write", "created_at",
                       "created_by__username", "handoff_from_id", "handoff_to__id")


def sessions_list_qs() -> QuerySet:
    return Session.objects.select_related("connection", "created_by", "handoff_to").only(*SESSION_LIST_FIELDS)


def turns_qs() -> QuerySet:
    return Turn.objects.select_related("session")


def turns_stalled() -> QuerySet:
    """Running turns flagged stalled (sessions_app/stalls.py), longest stalled first, with their
    evidence in ``stall_evidence`` (redacted): for the dashboard's needs-attention list, the
    changelist filter and the API."""
    return (Turn.objects.filter(status=states.RUNNING, stalled_at__isnull=False)
            .select_related("session", "connection").order_by("stalled_at"))


def get_or_404(qs: QuerySet, pk):
    try:
        obj = qs.filter(pk=pk).first()
    except (ValueError, TypeError):
        obj = None
    if obj is None:
        raise ApplicationError("not_found", "not found")
    return obj


def takeover_for(session: Session) -> dict | None:
    """§4.5: the command an operator runs in the session's directory to continue in a terminal,
    as the backend's adapter builds it (the same adapters the daemon uses)."""
    from agents.backends import get_backend

    if not session.backend_session_id:
        return None  # never fall back to a portal id
    try:
        command = get_backend(session.backend).takeover_command(session.backend_session_id, session.cwd)
    except KeyError:
        command = None
    if not command:
        return None  # dsh keeps no session
    return {"backend_session_id": session.backend_session_id, "cwd": session.cwd,
            "command": f"cd {shlex.quote(session.cwd)} && {command}"}


def connection_out(c: Connection) -> dict:
    return {
        "id": c.id, "name": c.name, "host": c.host, "backend": c.backend, "cwds": c.cwds, "status": c.status,
        "max_concurrency": c.max_concurrency, "sigint_timeout_s": c.sigint_timeout_s,
        "last_heartbeat_at": c.last_heartbeat_at, "daemon_version": c.daemon_version,
        "capabilities": c.capabilities, "created_at": c.created_at,
    }


def connection_spool_health(c: Connection) -> dict:
    """What the daemon last said of its report spool (hello, heartbeats, snapshots), for its page."""
    spool = (c.capabilities or {}).get("spool")
    if not isinstance(spool, dict):
        return {"reported": False}
    out = {"reported": True, "queued": 0, "parked": 0, "refused_total": 0, "unspooled": 0,
           "oldest_queued_age_s": None, "oldest_parked_age_s": None, "last_refusal": None, **spool}
    refusal = out["last_refusal"]
    if isinstance(refusal, dict) and isinstance(refusal.get("at"), (int, float)):
        at = datetime.fromtimestamp(refusal["at"], tz=timezone.get_current_timezone())
        out["last_refusal"] = {**refusal, "at_text": at.strftime("%Y-%m-%d %H:%M:%S")}
    return out


def session_out(s: Session, *, detail: bool = False) -> dict:
    try:
        handoff_to = s.handoff_to.id
    except Session.DoesNotExist:
        handoff_to = None
    out = {
        "id": s.id, "idea_key": s.idea_key, "title": s.title, "connection_id": s.connection_id,
        "connection_name": s.connection.name, "cwd": s.cwd, "backend": s.backend,
        "backend_session_id": s.backend_session_id, "provider": s.provider, "model": s.model, "status": s.status,
        "last_turn_at": s.last_turn_at,
        "tokens": {"input": s.tokens_input, "output": s.tokens_output, "cache_read": s.tokens_cache_read,
                   "cache_write": s.tokens_cache_write},
        "created_at": s.created_at, "created_by": s.created_by.get_username() if s.created_by else None,
        "handoff_from": s.handoff_from_id, "handoff_to": handoff_to,
    }
    if detail:
        out["takeover"] = takeover_for(s)
    return out


def wake_error_out(wake_error: dict | None, *, with_details: bool) -> dict | None:
    if not wake_error:
        return None
    return {
        "summary": wake_error.get("summary") or "",
        "kind": wake_error.get("kind") or "",
        "source": wake_error.get("source") or "",
        "exit_code": wake_error.get("exit_code"),
        "signal": wake_error.get("signal"),
        "details": wake_error.get("details") if with_details else None,
        "details_withheld": not with_details,
    }


def turn_retrying(t: Turn) -> dict | None:
    """While a running turn's CLI retries a failed model call itself (Claude Code's ``api_retry``,
    Codex's "Reconnecting..."), what it says: the turn's latest output is a progress line with
    ``retry`` data (agents/backends/claude_code.py, codex.py). Any other output after it (the model
    answered, a tool ran) clears it; so does leaving ``running``. Read from the event log, newest
    first on the session stream's (stream, id) index: one short query, and only for running turns."""
    if t.status != states.RUNNING:
        return None
    from chorus_site.models import Event

    latest = (Event.objects.filter(stream=t.stream, kind="turn.output").order_by("-id")
              .values_list("data", "at").first())
    if latest is None:
        return None
    data, at = latest
    output = data.get("data") if isinstance(data.get("data"), dict) else {}
    retry = output.get("retry")
    if data.get("id") != str(t.pk) or data.get("type") != "progress" or not isinstance(retry, dict):
        return None
    try:
        next_at = at + timedelta(milliseconds=float(retry.get("retry_delay_ms")))
    except (TypeError, ValueError):
        next_at = None

    def number(name):
        return retry.get(name) if isinstance(retry.get(name), int) else None

    return {"message": str(output.get("message") or "retrying"), "attempt": number("attempt"),
            "max_retries": number("max_retries"), "error": None if retry.get("error") is None else str(retry["error"]),
            "error_status": number("error_status"), "since": at, "next_attempt_at": next_at}


def turn_out(t: Turn, *, with_details: bool = False) -> dict:
    return {
        "id": t.id, "session_id": t.session_id, "connection_id": t.connection_id, "seq": t.seq,
        "trigger": t.trigger, "prompt": t.prompt,
        "status": t.status, "interrupted_reason": t.interrupted_reason, "stop_state": t.stop_state,
        "wake_error": wake_error_out(t.wake_error, with_details=with_details),
        "interrupt_evidence": t.interrupt_evidence, "usage": t.usage, "attempt_id": t.attempt_id,
        "created_at": t.created_at, "started_at": t.started_at, "ended_at": t.ended_at,
        "final_reply": t.final_reply, "changes": t.changes, "background_processes": t.background_processes,
        "requires_action": t.requires_action, "retrying": turn_retrying(t),
        "stalled": t.stalled_at is not None, "stalled_at": t.stalled_at, "stall_evidence": t.stall_evidence,
    }


def turn_diagnostics(t: Turn, *, for_sharing: bool) -> dict:
    wake_error = dict(t.wake_error) if t.wake_error else None
    if wake_error and for_sharing:
        wake_error["details"] = redact(wake_error.get("details") or "")
    return {"turn_id": t.id, "status": t.status, "interrupted_reason": t.interrupted_reason,
            "wake_error": wake_error, "redacted_for_sharing": for_sharing}


def transcript_qs(session_id) -> QuerySet:
    return TranscriptMessage.objects.filter(session_id=session_id)


def transcript_out(m: TranscriptMessage) -> dict:
    return {"id": m.id, "turn_id": m.turn_id, "role": m.role, "text": m.text, "at": m.at}


def turn_runner_connection(turn: Turn) -> Connection:
    """The connection that runs (ran) the turn: its commands go there, only its daemon reports on it.

    A turn not yet dispatched has none of its own; it will run on its session's connection.
    """
    return turn.connection if turn.connection_id else turn.session.connection


def connection_is_live(c: Connection, now=None) -> bool:
    now = now or timezone.now()
    return (c.status == states.CONN_ONLINE and c.last_heartbeat_at is not None
            and now - c.last_heartbeat_at <= heartbeat_timeout())


def resume_preflight(session: Session) -> dict:
    """What an operator should know before resuming (§4.3); computed, changes nothing."""
    from .services import cwd_allowed

    now = timezone.now()
    last = session.turns.order_by("-seq").first()
    online = connection_is_live(session.connection, now)
    refusal = None
    # §4.3 (amended): a turn settled offline (killed with its daemon) resumes like a crash.
    resumable_reasons = {states.REASON_USER, states.REASON_CRASH, states.REASON_TIMEOUT, states.REASON_SHUTDOWN,
                         states.REASON_OFFLINE}
    if session.status != states.SESSION_ACTIVE:
        refusal = "the session has ended (it was handed off); continue in the new session"
    elif last is None:
        refusal = "the session has no turn to resume"
    elif last.status == states.REQUIRES_ACTION:
        items = (last.requires_action or {}).get("items") or []
        if any(not item.get("answered") for item in items):
            refusal = "the latest turn has unanswered required actions"
    elif not (last.status == states.INTERRUPTED and last.interrupted_reason in resumable_reasons):
        refusal = f"the latest turn is {last.status_label}, which cannot be resumed"
    if refusal is None and not online:
        refusal = "the original connection is offline: restore the daemon first"
    return {
        "session_id": session.id,
        "resumable": refusal is None,
        "refusal": refusal,
        "connection_status": session.connection.status,
        "connection_online": online,
        "cwd": session.cwd,
        "cwd_allowed": cwd_allowed(session.connection, session.cwd),
        "backend_session_id_present": bool(session.backend_session_id),
        "last_turn_status": last.status if last else None,
        "last_turn_reason": (last.interrupted_reason or None) if last else None,
        "last_turn_age_s": (now - (last.ended_at or last.created_at)).total_seconds() if last else None,
        "files_changed_since": (last.changes or {}) if last else {},
        # HEAD as the daemon reported it when the last turn ended; the daemon checks the cwd again on resume.
        "git_head_then": ((last.changes or {}).get("head") if last else None),
    }


def diagnostics_visible(user) -> bool:
    return can_view_diagnostics(user)


# git status --porcelain XY codes, as an operator reads them.
CHANGE_LABELS = {"M": "modified", "A": "added", "D": "deleted", "R": "renamed", "C": "copied", "T": "type changed",
                 "U": "conflict", "??": "untracked (new)", "!!": "ignored"}


def changes_view(changes: dict | None) -> dict | None:
    """A turn's ``changes`` as the admin shows them: a file list with status letters and the diff.

    ``changes`` is what the daemon reported (agents/changes.py): git porcelain lines, or files
    modified since the spawn outside git.  None when nothing was reported.
    """
    if not isinstance(changes, dict) or not changes:
        return None
    files = []
    if changes.get("git"):
        for line in changes.get("status") or []:
            code, path = line[:2], line[3:]
            if code in {"??", "!!"}:
                letters, label = code, CHANGE_LABELS[code]
            else:  # X: the index, Y: the work tree
                letters = code.strip()
                label = ", ".join(CHANGE_LABELS.get(c, c) for c in dict.fromkeys(letters))
            files.append({"letters": letters, "path": path, "label": label})
    else:
        files = [{"letters": "M", "path": path, "label": "modified since the agent started"}
                 for path in changes.get("files") or []]
    return {"git": bool(changes.get("git")), "files": files, "diff_stat": changes.get("diff_stat") or "",
            "diff": changes.get("diff") or "", "diff_truncated": bool(changes.get("diff_truncated")),
            "truncated": bool(changes.get("truncated")), "head": changes.get("head") or "",
            "error": changes.get("error") or ""}


def attach_last_turns(sessions) -> None:
    """Give each session of a page ``last_turn_seq/status/reason``: one query for the whole page
    (each session's latest turn through the (session, seq) unique index), not one per row, and
    nothing added to the list's count query."""
    sessions = list(sessions)
    if not sessions:
        return
    from django.db.models import OuterRef, Subquery

    latest = Turn.objects.filter(session=OuterRef("pk")).order_by("-seq")
    rows = {row["pk"]: row for row in Session.objects.filter(pk__in=[s.pk for s in sessions]).annotate(
        t_seq=Subquery(latest.values("seq")[:1]), t_status=Subquery(latest.values("status")[:1]),
        t_reason=Subquery(latest.values("interrupted_reason")[:1])).values("pk", "t_seq", "t_status", "t_reason")}
    for session in sessions:
        row = rows.get(session.pk) or {}
        session.last_turn_seq = row.get("t_seq")
        session.last_turn_status = row.get("t_status")
        session.last_turn_reason = row.get("t_reason")


def session_state(session: Session, *, seq=None, status=None, reason=None) -> tuple[str, str]:
    """(what the session is doing, why / what to do) as the operator reads it: "active" alone
    says nothing of a session whose last turn crashed."""
    if session.status == states.SESSION_ENDED:
        return "ended", "no new turns: a hand-off continues it in a new session"
    if status is None:
        return "active", "no turn yet"
    if status == states.RUNNING:
        return "working", f"turn #{seq} is running"
    if status == states.PENDING:
        return "working", f"turn #{seq} is pending (see the turn for why)"
    if status == states.REQUIRES_ACTION:
        return "needs attention", f"turn #{seq} waits for an answer"
    if status == states.INTERRUPTED:
        label = f"interrupted ({reason})" if reason else "interrupted"
        if reason == states.REASON_USER:
            return "idle", f"turn #{seq} was {label}; resume or send a message"
        return "needs attention", f"turn #{seq} was {label}; resume or hand off"
    return "idle", f"turn #{seq} {status.replace('_', ' ')}; send a message to continue"


def pending_reason(turn: Turn, connection: Connection | None = None) -> str:
    """Why a pending turn has not started (for its page and lists); "" when it is not pending."""
    if turn.status != states.PENDING:
        return ""
    connection = connection or turn.connection or turn.session.connection
    if connection.status == states.CONN_DRAINING:
        return f"connection {connection.name} is draining: it takes no new work"
    if not connection_is_live(connection):
        return (f"connection {connection.name} is offline: it starts when its daemon is back, or is settled "
                f"interrupted (offline) after {settings.CHORUS_HEARTBEAT_TIMEOUT_S} s")
    earlier = (Turn.objects.filter(session_id=turn.session_id, seq__lt=turn.seq,
                                   status__in=[states.RUNNING, states.REQUIRES_ACTION, states.PENDING])
               .order_by("-seq").values_list("seq", flat=True).first())
    if earlier is not None:
        return f"queued behind turn #{earlier} of the session"
    return f"sent to {connection.name}: waiting for its daemon to start it"
