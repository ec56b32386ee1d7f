"""Acting routes of sessions_app (SPEC §8), each accepting an Idempotency-Key."""

from __future__ import annotations

from uuid import UUID

from django.db import transaction
from ninja import Schema

from chorus_site.api import ErrorBody, act, require_perm
from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError

from . import actions, services, states
from .api import router  # one router per app: ninja serves one path from one router only
from .models import Connection, Turn

ERRORS = {400: ErrorBody, 401: ErrorBody, 403: ErrorBody, 404: ErrorBody, 409: ErrorBody, 422: ErrorBody}


class StartIn(Schema):
    connection: UUID
    cwd: str
    prompt: str
    idea_key: str | None = None
    title: str = ""
    acknowledge_changes: bool = False
    reason: str | None = None


class PromptIn(Schema):
    prompt: str
    reason: str | None = None


class ContextIn(Schema):
    context: str = ""
    reason: str | None = None


class HandoffIn(Schema):
    context: str = ""
    connection: UUID | None = None
    cwd: str | None = None
    reason: str | None = None


class ReasonIn(Schema):
    reason: str | None = None


class AnswerIn(Schema):
    id: str
    answer: str


class AnswersIn(Schema):
    answers: list[AnswerIn]
    reason: str | None = None


class ConnectionIn(Schema):
    name: str
    backend: str
    cwds: list[str]
    host: str = ""
    max_concurrency: int = 4
    sigint_timeout_s: int = 10
    auto_resume_crashed: bool = False


@router.post("/sessions", response={201: dict, 200: dict, **ERRORS}, summary="Start work (§4.6)")
def session_start(request, body: StartIn):
    data = body.dict()
    return act(request, perm="sessions_app.start_session", route="sessions.start", body=data, status=201,
               action=lambda user, key: actions.session_start(
                   actor=user, connection_id=body.connection, cwd=body.cwd, prompt=body.prompt,
                   idea_key=body.idea_key, title=body.title, acknowledge_changes=body.acknowledge_changes,
                   reason=body.reason, idempotency_key=key))


@router.post("/sessions/{session_id}/messages", response={200: dict, **ERRORS}, summary="Send a message (§4.6)")
def session_message(request, session_id: UUID, body: PromptIn):
    return act(request, perm="sessions_app.message_session", route=f"sessions.message:{session_id}", body=body.dict(),
               action=lambda user, key: actions.session_message(actor=user, session_id=session_id, prompt=body.prompt,
                                                                reason=body.reason, idempotency_key=key))


@router.post("/sessions/{session_id}/resume", response={200: dict, **ERRORS}, summary="Resume (§4.3)")
def session_resume(request, session_id: UUID, body: ContextIn):
    return act(request, perm="sessions_app.resume_session", route=f"sessions.resume:{session_id}", body=body.dict(),
               action=lambda user, key: actions.session_resume(actor=user, session_id=session_id, context=body.context,
                                                               reason=body.reason, idempotency_key=key))


@router.post("/sessions/{session_id}/handoff", response={200: dict, **ERRORS}, summary="Hand off (§4.4)")
def session_handoff(request, session_id: UUID, body: HandoffIn):
    return act(request, perm="sessions_app.handoff_session", route=f"sessions.handoff:{session_id}",
               body=body.dict(), action=lambda user, key: actions.session_handoff(
                   actor=user, session_id=session_id, context=body.context, connection_id=body.connection,
                   cwd=body.cwd, reason=body.reason, idempotency_key=key))


@router.post("/turns/{turn_id}/interrupt", response={200: dict, **ERRORS}, summary="Interrupt (§4.1)")
def turn_interrupt(request, turn_id: UUID, body: ReasonIn = None):
    reason = body.reason if body else None
    return act(request, perm="sessions_app.interrupt_turn", route=f"turns.interrupt:{turn_id}",
               body={"reason": reason}, action=lambda user, key: actions.turn_interrupt(
                   actor=user, turn_id=turn_id, reason=reason, idempotency_key=key))


@router.post("/turns/{turn_id}/mark-interrupted", response={200: dict, **ERRORS},
             summary="Clear a stuck running turn (§4.2)")
def turn_mark_interrupted(request, turn_id: UUID, body: ReasonIn = None):
    reason = body.reason if body else None
    user = require_perm(request, "sessions_app.mark_interrupted_turn")
    try:
        evidence = actions.turn_gather_evidence(turn_id=turn_id)  # outside a transaction: it may probe
    except ApplicationError as refused:
        audit_record(actor=user, action="turn.mark_interrupted", target=f"turn:{turn_id}",
                     outcome=f"refused: {refused.code}", client="api", reason=reason)
        raise
    return act(request, perm="sessions_app.mark_interrupted_turn", route=f"turns.mark_interrupted:{turn_id}",
               body={"reason": reason}, action=lambda user, key: actions.turn_mark_interrupted(
                   actor=user, turn_id=turn_id, evidence=evidence, reason=reason, idempotency_key=key))


@router.post("/turns/{turn_id}/actions", response={200: dict, **ERRORS},
             summary="Answer a turn's required actions")
def turn_answer(request, turn_id: UUID, body: AnswersIn):
    return act(request, perm="sessions_app.answer_turn", route=f"turns.actions:{turn_id}", body=body.dict(),
               action=lambda user, key: turn_answer_actions(user, turn_id, [a.dict() for a in body.answers],
                                                            body.reason, key))


def turn_answer_actions(user, turn_id, answers, reason, key) -> dict:
    with transaction.atomic():
        turn = Turn.objects.select_for_update().filter(pk=turn_id).first()
        if turn is None:
            raise ApplicationError("not_found", "not found")
        pending = turn.requires_action or {}
        items = pending.get("items") or []
        if not items:
            raise ApplicationError("invalid_transition", "this turn asks for no action")
        known = {str(item.get("id")) for item in items}
        unknown = [a["id"] for a in answers if a["id"] not in known]
        if unknown:
            raise ApplicationError("bad_request", "unknown action items", {"unknown": unknown})
        by_id = {a["id"]: a["answer"] for a in answers}
        for item in items:
            if str(item.get("id")) in by_id:
                item.update(answered=True, answer=by_id[str(item["id"])])
        Turn.objects.filter(pk=turn.pk).update(requires_action={**pending, "items": items})
        audit_record(actor=user, action="turn.answer", target=f"turn:{turn.pk}", outcome=f"{len(by_id)} answered",
                     client="api", reason=reason, idempotency_key=key)
        all_answered = all(item.get("answered") for item in items)
        answer = {"changed": True, "all_answered": all_answered}
        if all_answered and turn.status != states.RUNNING:
            text = "\n".join(f"{item.get('text')}: {item.get('answer')}" for item in items)
            answer.update(actions.session_resume(actor=user, session_id=turn.session_id, context=text, reason=reason))
    return answer


@router.post("/connections", response={201: dict, **ERRORS}, summary="Register a connection (key shown once)")
def connection_register(request, body: ConnectionIn):
    def register(user, key):
        if Connection.objects.filter(name=body.name).exists():
            raise ApplicationError("conflict", f"a connection named {body.name!r} exists")
        connection, secret = services.connection_register(
            name=body.name, backend=body.backend, cwds=body.cwds, host=body.host,
            max_concurrency=body.max_concurrency, sigint_timeout_s=body.sigint_timeout_s,
            auto_resume_crashed=body.auto_resume_crashed, actor=user)
        audit_record(actor=user, action="connection.register", target=f"connection:{connection.pk}",
                     outcome="registered", client="api", idempotency_key=key)
        return {"id": str(connection.pk), "name": connection.name, "key": secret}

    return act(request, perm="sessions_app.add_connection", route="connections.register", body=body.dict(),
               status=201, action=register)


def _drain(request, connection_id, to):
    def drain(user, key):
        connection = Connection.objects.filter(pk=connection_id).first()
        if connection is None:
            raise ApplicationError("not_found", "not found")
        if (to == states.CONN_DRAINING) == (connection.status == states.CONN_DRAINING):
            return {"changed": False, "status": connection.status}
        target = to if to == states.CONN_DRAINING else (
            states.CONN_ONLINE if connection.last_heartbeat_at else states.CONN_OFFLINE)
        connection = services.connection_set_status(connection_id=connection.pk, status=target, actor=user)
        audit_record(actor=user, action=f"connection.{'drain' if to == states.CONN_DRAINING else 'undrain'}",
                     target=f"connection:{connection.pk}", outcome=connection.status, client="api",
                     idempotency_key=key)
        return {"changed": True, "status": connection.status}

    return act(request, perm="sessions_app.drain_connection", route=f"connections.{to}:{connection_id}", body={},
               action=drain)


@router.post("/connections/{connection_id}/drain", response={200: dict, **ERRORS}, summary="Drain (admin)")
def connection_drain(request, connection_id: UUID):
    return _drain(request, connection_id, states.CONN_DRAINING)


@router.post("/connections/{connection_id}/undrain", response={200: dict, **ERRORS}, summary="Undrain (admin)")
def connection_undrain(request, connection_id: UUID):
    return _drain(request, connection_id, states.CONN_ONLINE)
