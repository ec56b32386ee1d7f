"""Read routes of sessions_app (SPEC §8): connections, sessions, turns, transcripts, diagnostics."""

from __future__ import annotations

from uuid import UUID

from ninja import Router

from chorus_site.api import ErrorBody, filter_or_400, paginate, query_params, require_ops
from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError

from . import selectors as sel
from . import troubleshooting
from .filters import ConnectionFilter, SessionFilter, TurnFilter
from .schemas import (
    ConnectionOut, ConnectionPage, DiagnosticsOut, PreflightOut, SessionOut, SessionPage, TranscriptPage, TurnOut,
    TurnPage,
)

router = Router(tags=["sessions"])
ERRORS = {400: ErrorBody, 401: ErrorBody, 403: ErrorBody, 404: ErrorBody, 409: ErrorBody, 410: ErrorBody}


@router.get("/connections", response={200: ConnectionPage, **ERRORS}, summary="List connections")
def connections_list(request, status: str = None, backend: str = None, host: str = None, limit: int = 50,
                     cursor: str = None):
    require_ops(request)
    qs = filter_or_400(ConnectionFilter, query_params(request, "status", "backend", "host"), sel.connections_qs())
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.connection_out)


@router.get("/connections/{connection_id}", response={200: ConnectionOut, **ERRORS}, summary="Connection detail")
def connection_detail(request, connection_id: UUID):
    require_ops(request)
    return sel.connection_out(sel.get_or_404(sel.connections_qs(), connection_id))


@router.get("/sessions", response={200: SessionPage, **ERRORS}, summary="List sessions")
def sessions_list(request, status: str = None, backend: str = None, connection: UUID = None, cwd: str = None,
                  idea_key: str = None, q: str = None, limit: int = 50, cursor: str = None):
    require_ops(request)
    qs = filter_or_400(SessionFilter, query_params(request, "status", "backend", "connection", "cwd", "idea_key", "q"),
                       sel.sessions_list_qs())
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.session_out)


@router.get("/sessions/{session_id}", response={200: SessionOut, **ERRORS}, summary="Session detail with takeover")
def session_detail(request, session_id: UUID):
    require_ops(request)
    return sel.session_out(sel.get_or_404(sel.sessions_qs(), session_id), detail=True)


@router.get("/sessions/{session_id}/turns", response={200: TurnPage, **ERRORS}, summary="Turns of a session")
def session_turns(request, session_id: UUID, status: str = None, interrupted_reason: str = None, trigger: str = None,
                  stalled: bool = None, limit: int = 50, cursor: str = None):
    require_ops(request)
    session = sel.get_or_404(sel.sessions_qs(), session_id)
    qs = filter_or_400(TurnFilter, query_params(request, "status", "interrupted_reason", "trigger", "stalled"),
                       sel.turns_qs().filter(session=session))
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.turn_out)


@router.get("/sessions/{session_id}/transcript", response={200: TranscriptPage, **ERRORS},
            summary="Transcript (user and assistant text, newest 200)")
def session_transcript(request, session_id: UUID, limit: int = 200, cursor: str = None):
    require_ops(request)
    session = sel.get_or_404(sel.sessions_qs(), session_id)
    return paginate(sel.transcript_qs(session.id), limit=limit, cursor=cursor, descending=False,
                    serialize=sel.transcript_out)


@router.get("/sessions/{session_id}/resume-preflight", response={200: PreflightOut, **ERRORS},
            summary="What resuming would do (§4.3)")
def session_resume_preflight(request, session_id: UUID):
    require_ops(request)
    return sel.resume_preflight(sel.get_or_404(sel.sessions_qs(), session_id))


@router.get("/sessions/{session_id}/troubleshooting", response={200: dict, **ERRORS},
            summary="Troubleshooting record (§9): JSON, or Markdown with ?format=md; redacted unless ?redacted=0")
def session_troubleshooting(request, session_id: UUID, format: str = "json", redacted: bool = True,
                            details: bool = False):
    """``?redacted=0`` and ``?details=1`` are for ops_diagnostics (403 otherwise) and audited."""
    user = require_ops(request)
    session = sel.get_or_404(sel.sessions_qs(), session_id)
    troubleshooting.export_options(user, redacted=redacted, details=details)
    record = troubleshooting.session_record(session, redacted=redacted, include_details=details)
    return troubleshooting.export_response(user=user, record=record, target=f"session:{session.pk}",
                                           filename=f"session-{session.pk}", fmt=format,
                                           markdown=troubleshooting.session_markdown)


@router.get("/turns/{turn_id}", response={200: TurnOut, **ERRORS},
            summary="Turn detail (diagnostic details only for ops_diagnostics)")
def turn_detail(request, turn_id: UUID):
    user = require_ops(request)
    turn = sel.get_or_404(sel.turns_qs(), turn_id)
    with_details = sel.diagnostics_visible(user) and bool(turn.wake_error)
    if with_details:
        audit_record(actor=user, action="diagnostics.view", target=f"turn:{turn.id}", outcome="shown", client="api")
    return sel.turn_out(turn, with_details=with_details)


@router.get("/turns/{turn_id}/diagnostics", response={200: DiagnosticsOut, **ERRORS},
            summary="Raw diagnostic details (ops_diagnostics; every view audited)")
def turn_diagnostics(request, turn_id: UUID, redacted: bool = False):
    user = require_ops(request)
    turn = sel.get_or_404(sel.turns_qs(), turn_id)
    if not sel.diagnostics_visible(user):
        raise ApplicationError("forbidden", "raw diagnostics are shown only to the ops_diagnostics role")
    audit_record(actor=user, action="diagnostics.view", target=f"turn:{turn.id}",
                 outcome="shown redacted" if redacted else "shown", client="api")
    return sel.turn_diagnostics(turn, for_sharing=redacted)
