"""Acting routes of sessions_app (SPEC §8), each accepting an Idempotency-Key."""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

from ninja import Field, Schema
from pydantic import StringConstraints

from chorus_site.api import ErrorBody, act, require_perm
from chorus_site.api_input import Count, Enum, Text
from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError

from . import actions, services, states
from .api import router  # one router per app: ninja serves one path from one router only
from .models import Connection

ERRORS = {400: ErrorBody, 401: ErrorBody, 403: ErrorBody, 404: ErrorBody, 409: ErrorBody, 413: ErrorBody,
          422: ErrorBody}


class StartIn(Schema):
    connection: UUID
    cwd: str = Text(1024)
    prompt: str
    idea_key: str | None = Text(255, None)
    title: str = Text(255, "")
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
    cwd: str | None = Text(1024, None)
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
    name: str = Text(100)
    backend: str = Enum(states.BACKENDS)
    cwds: list[Annotated[str, StringConstraints(max_length=1024)]] = Field(..., min_length=1)
    host: str = Text(255, "")
    max_concurrency: int = Count(4, ge=1)
    sigint_timeout_s: int = Count(10)
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
               action=lambda user, key: actions.turn_answer(actor=user, turn_id=turn_id,
                                                            answers=[a.dict() for a in body.answers],
                                                            reason=body.reason, idempotency_key=key))


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
               status=201, action=register, secret_fields=("key",))


def _drain(request, connection_id, drain: bool):
    return act(request, perm="sessions_app.drain_connection",
               route=f"connections.{'drain' if drain else 'undrain'}:{connection_id}", body={},
               action=lambda user, key: actions.connection_drain(actor=user, connection_id=connection_id, drain=drain,
                                                                 idempotency_key=key))


@router.post("/connections/{connection_id}/drain", response={200: dict, **ERRORS}, summary="Drain (admin)")
def connection_drain(request, connection_id: UUID):
    return _drain(request, connection_id, True)


@router.post("/connections/{connection_id}/undrain", response={200: dict, **ERRORS}, summary="Undrain (admin)")
def connection_undrain(request, connection_id: UUID):
    return _drain(request, connection_id, False)
