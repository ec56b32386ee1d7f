"""``/ws/live/``: browsers follow streams (SPEC §10).

Client → server: ``{"type": "subscribe", "stream": "session:<id>" | "run:<id>" | "connection:<id>" |
"dashboard", "after": <cursor>?}`` and ``{"type": "unsubscribe", "stream": ...}``.
Server → client: ``{"type": "event", "event": {...}}``, ``{"type": "subscribed", "stream", "cursor"}``,
``{"type": "error", "code", "message", "stream"}``.  Permission is checked on every subscribe.
Close code 4503: the channel layer broke (e.g. Redis restarted); reconnect and resubscribe with
each stream's last cursor (``after``) — nothing is lost, the log is read from there.
"""

from __future__ import annotations

import asyncio
import re

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from .access import Grant, grant_still_valid, recheck_interval
from .errors import ApplicationError
from .events import DASHBOARD_GROUP, parse_cursor, stream_group
from .layer_health import LAYER_LOST_CLOSE, LayerAwareConsumer
from .live import StreamPosition, accept_live, catch_up, position_at
from .permissions import has_ops_role

_STREAM = re.compile(r"^(session|run|connection|issue):[0-9a-f-]{36}$")
MAX_SUBSCRIPTIONS = 50


def _stream_exists(stream: str) -> bool:
    from executions.models import Issue, Run
    from sessions_app.models import Connection, Session

    kind, object_id = stream.split(":", 1)
    model = {"session": Session, "run": Run, "connection": Connection, "issue": Issue}[kind]
    try:
        return model.objects.filter(pk=object_id).exists()
    except (ValueError, TypeError):
        return False


def _may_follow(user, stream: str) -> bool:
    return has_ops_role(user) and (stream == "dashboard" or _stream_exists(stream))


class LiveConsumer(LayerAwareConsumer, AsyncJsonWebsocketConsumer):
    # A broken channel layer (Redis restarted: every group is gone) closes the socket with
    # LAYER_LOST_CLOSE; the client reconnects and resumes each stream from its cursor.
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.positions: dict[str, StreamPosition] = {}
        self.dashboard = False
        session = self.scope.get("session")
        self.grant = Grant(user_id=user.pk, session_key=getattr(session, "session_key", None))
        await self.accept()
        self.access_watch = asyncio.ensure_future(self._watch_access())

    async def _watch_access(self):
        """Close the socket once its holder loses access; drop streams whose object is gone."""
        while True:
            await asyncio.sleep(recheck_interval())
            if not await database_sync_to_async(grant_still_valid)(self.grant):
                for stream in [*self.positions, *(["dashboard"] if self.dashboard else [])]:
                    await self._unsubscribe(stream)  # nothing more is passed on
                await self._error("unauthorized", "access was revoked: sign in again")
                await self.close(code=4403)
                return
            for stream in list(self.positions):
                if not await database_sync_to_async(_stream_exists)(stream):
                    await self._unsubscribe(stream)
                    await self._error("not_found", "no such stream", stream)

    async def disconnect(self, code):
        watch = getattr(self, "access_watch", None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        for stream in list(getattr(self, "positions", {})):
            await self.layer_leave(stream_group(stream))
        if getattr(self, "dashboard", False):
            await self.layer_leave(DASHBOARD_GROUP)

    async def layer_failed(self, message=None):
        """The layer broke (here or in another follower of this process): nothing is woken any more."""
        if not getattr(self, "closed_for_layer", False):
            self.closed_for_layer = True
            await self.close(code=LAYER_LOST_CLOSE)

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict):
            return await self._error("bad_request", "messages are JSON objects")
        kind, stream = content.get("type"), content.get("stream")
        if kind == "subscribe":
            return await self._subscribe(stream, content.get("after"))
        if kind == "unsubscribe" and isinstance(stream, str):
            return await self._unsubscribe(stream)
        return await self._error("bad_request", "unknown message type", stream)

    async def _subscribe(self, stream, after):
        if not isinstance(stream, str) or not (stream == "dashboard" or _STREAM.match(stream)):
            return await self._error("bad_request", "stream must be session:<id>, run:<id>, connection:<id>, "
                                     "issue:<id> or dashboard",
                                     stream)
        # Re-read the user's permissions on every subscribe: a role removed mid-connection applies.
        user = await database_sync_to_async(_fresh_user)(self.scope["user"])
        if not await database_sync_to_async(_may_follow)(user, stream):
            return await self._error("not_found", "no such stream", stream)
        if stream == "dashboard":
            if not await self.layer_join(DASHBOARD_GROUP):
                return await self.layer_failed()
            self.dashboard = True
            return await self.send_json({"type": "subscribed", "stream": stream, "cursor": None})
        if len(self.positions) >= MAX_SUBSCRIPTIONS and stream not in self.positions:
            return await self._error("bad_request", f"at most {MAX_SUBSCRIPTIONS} streams per connection", stream)
        if not await self.layer_join(stream_group(stream)):  # joined before reading: nothing committed is missed
            return await self.layer_failed()
        try:
            position = await position_at(stream, parse_cursor(after))
        except ApplicationError as exc:
            await self.layer_leave(stream_group(stream))
            return await self._error(exc.code, exc.message, stream)
        self.positions[stream] = position
        await self.send_json({"type": "subscribed", "stream": stream, "cursor": position.last_id})
        async for message in catch_up(position):
            await self.send_json({"type": "event", "event": message})

    async def _unsubscribe(self, stream):
        if self.positions.pop(stream, None) is not None:
            await self.layer_leave(stream_group(stream))
        elif stream == "dashboard" and self.dashboard:
            self.dashboard = False
            await self.layer_leave(DASHBOARD_GROUP)

    async def event_message(self, payload):
        message = payload["event"]
        position = self.positions.get(message["stream"])
        if position is not None:
            async for event in accept_live(position, message):
                await self.send_json({"type": "event", "event": event})
        elif self.dashboard:
            await self.send_json({"type": "event", "event": message})

    async def _error(self, code, message, stream=None):
        await self.send_json({"type": "error", "code": code, "message": message, "stream": stream})


def _fresh_user(user):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.filter(pk=user.pk, is_active=True).first()
