"""``/ws/live/``: browsers follow streams (SPEC §10).

Client → server: ``{"type": "subscribe", "stream": "session:<id>" | "run:<id>" | "connection:<id>" |
"dashboard", "after": <cursor>?}`` and ``{"type": "unsubscribe", "stream": ...}``.
Server → client: ``{"type": "event", "event": {...}}``, ``{"type": "subscribed", "stream", "cursor"}``,
``{"type": "error", "code", "message", "stream"}``.  Permission is checked on every subscribe.
"""

from __future__ import annotations

import re

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from .errors import ApplicationError
from .events import DASHBOARD_GROUP, parse_cursor, stream_group
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


class LiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.positions: dict[str, StreamPosition] = {}
        self.dashboard = False
        await self.accept()

    async def disconnect(self, code):
        for stream in list(getattr(self, "positions", {})):
            await self.channel_layer.group_discard(stream_group(stream), self.channel_name)
        if getattr(self, "dashboard", False):
            await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

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
            self.dashboard = True
            await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
            return await self.send_json({"type": "subscribed", "stream": stream, "cursor": None})
        if len(self.positions) >= MAX_SUBSCRIPTIONS and stream not in self.positions:
            return await self._error("bad_request", f"at most {MAX_SUBSCRIPTIONS} streams per connection", stream)
        await self.channel_layer.group_add(stream_group(stream), self.channel_name)
        try:
            position = await position_at(stream, parse_cursor(after))
        except ApplicationError as exc:
            await self.channel_layer.group_discard(stream_group(stream), self.channel_name)
            return await self._error(exc.code, exc.message, stream)
        self.positions[stream] = position
        await self.send_json({"type": "subscribed", "stream": stream, "cursor": position.last_id})
        async for message in catch_up(position):
            await self.send_json({"type": "event", "event": message})

    async def _unsubscribe(self, stream):
        if self.positions.pop(stream, None) is not None:
            await self.channel_layer.group_discard(stream_group(stream), self.channel_name)
        elif stream == "dashboard" and self.dashboard:
            self.dashboard = False
            await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

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
