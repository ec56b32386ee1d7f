"""Event routes (SPEC §8, §10): stored events after a cursor as JSON, and the SSE streams."""

from __future__ import annotations

import asyncio
import json
from uuid import UUID

from channels.db import database_sync_to_async
from django.conf import settings
from django.http import JsonResponse, StreamingHttpResponse
from ninja import Router, Schema

from .access import Grant, grant_still_valid, recheck_interval
from .api import ErrorBody, require_ops
from .errors import ApplicationError
from .events import events_after, parse_cursor
from .live import follow
from .metrics import LIVE_CLIENTS
from .permissions import has_ops_role
from .throttling import client_ident, credential_failed, credential_gate
from .tokens import token_authenticate

router = Router(tags=["events"])
ERRORS = {400: ErrorBody, 401: ErrorBody, 404: ErrorBody, 409: ErrorBody, 410: ErrorBody}


class EventOut(Schema):
    id: int
    stream: str
    seq: int
    kind: str
    data: dict
    actor: str
    at: str


class EventPage(Schema):
    items: list[EventOut]
    next_cursor: int | None


def _stream_of(kind: str, object_id: UUID) -> str:
    from executions.models import Run
    from sessions_app.models import Session

    model = {"sessions": Session, "runs": Run}[kind]
    if not model.objects.filter(pk=object_id).exists():
        raise ApplicationError("not_found", "not found")
    return f"{'session' if kind == 'sessions' else 'run'}:{object_id}"


def _events_page(request, kind: str, object_id: UUID, after: str | None, limit: int):
    require_ops(request)
    if not 1 <= limit <= 500:
        raise ApplicationError("bad_request", "limit must be between 1 and 500")
    stream = _stream_of(kind, object_id)
    rows = events_after(stream, parse_cursor(after), limit=limit)
    items = [e.as_message() for e in rows]
    return {"items": items, "next_cursor": items[-1]["id"] if len(items) == limit else None}


@router.get("/sessions/{session_id}/events", response={200: EventPage, **ERRORS},
            summary="Stored events of a session after a cursor")
def session_events(request, session_id: UUID, after: str = None, limit: int = 200):
    return _events_page(request, "sessions", session_id, after, limit)


@router.get("/runs/{run_id}/events", response={200: EventPage, **ERRORS}, summary="Stored events of a run after a cursor")
def run_events(request, run_id: UUID, after: str = None, limit: int = 200):
    return _events_page(request, "runs", run_id, after, limit)


# ---------------------------------------------------------------- SSE
async def _stream_user(request):
    """Bearer token or session cookie; SSE is GET-only, so CSRF does not apply.

    Returns (user, grant): the grant is what the open stream re-checks (issue 8 item 6).
    """
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        ident = client_ident(request)
        credential_gate(ident, header[7:])  # 429 after too many failures
        user = await database_sync_to_async(token_authenticate)(header[7:])
        if user is None:
            credential_failed(ident, header[7:])
        return user, (Grant(user_id=user.pk, token=header[7:]) if user is not None else None)
    user = await request.auser()
    if not (user.is_authenticated and user.is_active):
        return None, None
    return user, Grant(user_id=user.pk, session_key=request.session.session_key)


def _error(exc: ApplicationError) -> JsonResponse:
    response = JsonResponse(exc.as_body(), status=exc.status)
    if exc.status == 429:
        response["Retry-After"] = str(exc.detail.get("retry_after_s", 60))
    return response


async def _while_allowed(follower, grant: Grant):
    """The follower's messages until the grant stops being valid (checked every few seconds).

    The follower runs in a task of its own feeding a queue, so the check does not wait for the
    next event or heartbeat, and cancelling a wait on the queue never interrupts the follower.
    """
    queue: asyncio.Queue = asyncio.Queue(maxsize=100)
    done = object()

    async def pump():
        try:
            async for message in follower:
                await queue.put(message)
        finally:
            await queue.put(done)

    task = asyncio.ensure_future(pump())
    interval = recheck_interval()
    loop = asyncio.get_running_loop()
    next_check = loop.time() + interval
    try:
        while True:
            if loop.time() >= next_check:  # also on a busy stream, where the queue never runs dry
                if not await database_sync_to_async(grant_still_valid)(grant):
                    return  # access revoked: the stream ends; a reconnect is refused
                next_check = loop.time() + interval
            try:
                message = await asyncio.wait_for(queue.get(), timeout=max(0.0, next_check - loop.time()))
            except asyncio.TimeoutError:
                continue
            if message is done:
                return
            yield message
    finally:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        await follower.aclose()


def sse_frame(message: dict) -> str:
    return f"id: {message['id']}\nevent: {message['kind']}\ndata: {json.dumps(message, separators=(',', ':'))}\n\n"


async def _sse(request, kind: str, object_id: UUID, after: str | None):
    try:
        user, grant = await _stream_user(request)
    except ApplicationError as exc:
        return _error(exc)
    if user is None:
        return _error(ApplicationError("unauthorized", "authentication required (session cookie or Bearer token)"))
    try:
        if not await database_sync_to_async(has_ops_role)(user):
            raise ApplicationError("not_found", "not found")
        stream = await database_sync_to_async(_stream_of)(kind, object_id)
        # Last-Event-ID wins over ?after= (it is the newer: the browser sets it on reconnect).
        cursor = parse_cursor(request.headers.get("Last-Event-ID") or after)
        follower = follow(stream, cursor, heartbeat_s=settings.CHORUS_SSE_HEARTBEAT_S)
        await follower.__anext__()  # validates the cursor: errors are still plain responses here
    except ApplicationError as exc:
        return _error(exc)

    async def body():
        LIVE_CLIENTS.labels("sse").inc()  # /metrics: open SSE streams
        try:
            yield ": connected\n\n"
            async for message in _while_allowed(follower, grant):
                yield ": heartbeat\n\n" if message is None else sse_frame(message)
        finally:
            LIVE_CLIENTS.labels("sse").dec()

    response = StreamingHttpResponse(body(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


@router.get("/sessions/{session_id}/events/stream", auth=None, response={200: str, **ERRORS},
            summary="Server-Sent Events of a session (Last-Event-ID or ?after= to resume)",
            openapi_extra={"security": [{"SessionCookieAuth": []}, {"TokenAuth": []}]})
async def session_events_stream(request, session_id: UUID, after: str = None):
    return await _sse(request, "sessions", session_id, after)


@router.get("/runs/{run_id}/events/stream", auth=None, response={200: str, **ERRORS},
            summary="Server-Sent Events of a run (Last-Event-ID or ?after= to resume)",
            openapi_extra={"security": [{"SessionCookieAuth": []}, {"TokenAuth": []}]})
async def run_events_stream(request, run_id: UUID, after: str = None):
    return await _sse(request, "runs", run_id, after)
