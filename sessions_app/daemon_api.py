"""Daemon report routes (SPEC §8): advance, events, snapshot — authenticated by connection key."""

from __future__ import annotations

from uuid import UUID

from ninja import Router, Schema, Status
from ninja.security import HttpBearer

from chorus_site.api import ErrorBody

from . import bridge

ERRORS = {400: ErrorBody, 401: ErrorBody, 404: ErrorBody, 409: ErrorBody}


class ConnectionKeyAuth(HttpBearer):
    def authenticate(self, request, token):
        connection = bridge.connection_authenticate(token)
        if connection is not None:
            request.daemon_connection = connection
        return connection


router = Router(tags=["daemon"], auth=ConnectionKeyAuth())


class AdvanceIn(Schema):
    report_id: str
    status: str | None = None
    reason: str | None = None
    stop_state: str | None = None
    pid: int | None = None
    backend_session_id: str | None = None
    final_reply: str | None = None
    usage: dict | None = None
    changes: dict | None = None
    background_processes: list | None = None
    wake_error: dict | None = None
    requires_action: dict | None = None
    outcome: dict | None = None


class EventIn(Schema):
    kind: str
    data: dict = {}


class EventsIn(Schema):
    report_id: str
    events: list[EventIn]


class SnapshotIn(Schema):
    report_id: str | None = None
    running: list[dict]


@router.post("/daemon/turns/{turn_id}/advance", response={200: dict, **ERRORS}, summary="Daemon: a turn's lifecycle step")
def daemon_advance(request, turn_id: UUID, body: AdvanceIn):
    status, answer, _ = bridge.report_advance(connection=request.auth, turn_id=turn_id,
                                              report=body.dict(exclude_none=True))
    return Status(status, answer)


@router.post("/daemon/turns/{turn_id}/events", response={200: dict, **ERRORS}, summary="Daemon: a batch of agent events")
def daemon_events(request, turn_id: UUID, body: EventsIn):
    report = {"report_id": body.report_id, "events": [e.dict() for e in body.events]}
    status, answer, _ = bridge.report_events(connection=request.auth, turn_id=turn_id, report=report)
    return Status(status, answer)


@router.post("/daemon/snapshot", response={200: dict, **ERRORS}, summary="Daemon: its running turns")
def daemon_snapshot(request, body: SnapshotIn):
    bridge.connection_store_snapshot(connection_id=request.auth.pk, running=body.running)
    return Status(200, {"stored": len(body.running)})
