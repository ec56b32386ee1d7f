"""Daemon report routes (SPEC §8): advance, events, snapshot — authenticated by connection key."""

from __future__ import annotations

from uuid import UUID

from ninja import Router, Status
from ninja.security import HttpBearer

from chorus_site.api import ErrorBody
from chorus_site.throttling import client_ident, credential_gate

from . import bridge, daemon_schemas

ERRORS = {400: ErrorBody, 401: ErrorBody, 404: ErrorBody, 409: ErrorBody, 413: ErrorBody, 422: ErrorBody,
          429: ErrorBody}


class ConnectionKeyAuth(HttpBearer):
    def authenticate(self, request, token):
        credential_gate(client_ident(request), token)  # 429 after too many failures
        connection = bridge.connection_authenticate(token)
        if connection is not None:
            request.daemon_connection = connection
        return connection


router = Router(tags=["daemon"], auth=ConnectionKeyAuth())


# The shapes are shared with the WebSocket side (daemon_schemas): a report that does not validate
# is answered 422 with the §8 body and nothing of it is stored.
AdvanceIn = daemon_schemas.AdvanceReportIn
EventsIn = daemon_schemas.EventsReportIn
SnapshotIn = daemon_schemas.SnapshotReportIn


@router.post("/daemon/turns/{turn_id}/advance", response={200: dict, **ERRORS}, summary="Daemon: a turn's lifecycle step")
def daemon_advance(request, turn_id: UUID, body: AdvanceIn):
    status, answer, _ = bridge.report_advance(connection=request.auth, turn_id=turn_id,
                                              report=daemon_schemas.as_report(body))
    return Status(status, answer)


@router.post("/daemon/turns/{turn_id}/events", response={200: dict, **ERRORS}, summary="Daemon: a batch of agent events")
def daemon_events(request, turn_id: UUID, body: EventsIn):
    report = daemon_schemas.as_report(body)
    status, answer, _ = bridge.report_events(connection=request.auth, turn_id=turn_id, report=report)
    return Status(status, answer)


@router.post("/daemon/snapshot", response={200: dict, **ERRORS}, summary="Daemon: its running turns")
def daemon_snapshot(request, body: SnapshotIn):
    bridge.connection_store_snapshot(connection_id=request.auth.pk, running=daemon_schemas.as_report(body)["running"])
    return Status(200, {"stored": len(body.running)})
