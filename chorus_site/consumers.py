"""``/ws/live/``: browsers follow streams (SPEC §10).

Client → server: ``{"type": "subscribe", "stream": "session:<id>" | "run:<id>" | "connection:<id>" |
"dashboard", "after": <cursor>?}`` and ``{"type": "unsubscribe", "stream": ...}``.
Server → client: ``{"type": "event", "event": {...}}``, ``{"type": "events", "stream", "events": [...]}``
(several events of one stream, oldest first), ``{"type": "subscribed", "stream", "cursor"}``,
``{"type": "error", "code", "message", "stream"}``.  Permission is checked on every subscribe.
Agent output (``turn.output``) arriving faster than one frame per COALESCE_S is held and sent as
one ``events`` frame (a page redraws a few times a second, not per line); every event still comes,
in order, and anything else (a status change) is sent at once, after the output held before it.
The API's SSE stream is not coalesced.
Close code 4503: the channel layer broke (e.g. Redis restarted); reconnect and resubscribe with
each stream's last cursor (``after``) — nothing is lost, the log is read from there.
"""

from __future__ import annotations

import asyncio
import json
import re

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from .access import Grant, grant_still_valid, recheck_interval
from .errors import ApplicationError
from .events import DASHBOARD_GROUP, OUTPUT_KINDS, parse_cursor, stream_group
from .layer_health import LAYER_LOST_CLOSE, LayerAwareConsumer
from .live import FOLLOWER_QUEUE_MAX, StreamPosition, accept_live, catch_up, local_fanout, position_at
from .metrics import LIVE_CLIENTS
from .permissions import has_ops_role

_STREAM = re.compile(r"^(session|run|connection|issue):[0-9a-f-]{36}$")
MAX_SUBSCRIPTIONS = 50
# At most one frame of agent output per stream this often (seconds).
COALESCE_S = 0.2
PROGRESS_KINDS = OUTPUT_KINDS


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
        self.held: dict[str, list[dict]] = {}      # stream -> output waiting for its frame
        self.last_frame_at: dict[str, float] = {}  # stream -> loop time of its last frame
        session = self.scope.get("session")
        self.grant = Grant(user_id=user.pk, session_key=getattr(session, "session_key", None))
        await self.accept()
        LIVE_CLIENTS.labels("ws").inc()  # /metrics; taken back in disconnect
        self.counted = True
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
        if getattr(self, "counted", False):
            self.counted = False
            LIVE_CLIENTS.labels("ws").dec()
        watch = getattr(self, "access_watch", None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        for stream in list(getattr(self, "positions", {})):
            await self._leave(stream_group(stream))
        if getattr(self, "dashboard", False):
            await self._leave(DASHBOARD_GROUP)

    # Live messages come through the process' fan-out (one layer channel per process), into this
    # consumer's local inbox, and are dispatched in order with everything else it handles.
    def _deliver(self, message):
        if self.local_inbox.qsize() < FOLLOWER_QUEUE_MAX:
            self.local_inbox.put_nowait(message)
        # else dropped: the next batch of that stream shows the gap by seq and reads the log

    async def _join(self, group: str) -> bool:
        if self.layer_lost:
            return False
        if await local_fanout(self.channel_layer).join(group, self, self._deliver):
            return True
        self.layer_lost = True
        return False

    async def _leave(self, group: str) -> None:
        await local_fanout(self.channel_layer).leave(group, self)

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
            if not await self._join(DASHBOARD_GROUP):
                return await self.layer_failed()
            self.dashboard = True
            return await self.send_json({"type": "subscribed", "stream": stream, "cursor": None})
        if len(self.positions) >= MAX_SUBSCRIPTIONS and stream not in self.positions:
            return await self._error("bad_request", f"at most {MAX_SUBSCRIPTIONS} streams per connection", stream)
        if not await self._join(stream_group(stream)):  # joined before reading: nothing committed is missed
            return await self.layer_failed()
        try:
            position = await position_at(stream, parse_cursor(after))
        except ApplicationError as exc:
            await self._leave(stream_group(stream))
            return await self._error(exc.code, exc.message, stream)
        self.positions[stream] = position
        await self.send_json({"type": "subscribed", "stream": stream, "cursor": position.last_id})
        async for message in catch_up(position):
            await self.send_json({"type": "event", "event": message})

    async def _unsubscribe(self, stream):
        if self.positions.pop(stream, None) is not None:
            self.held.pop(stream, None)
            await self._leave(stream_group(stream))
        elif stream == "dashboard" and self.dashboard:
            self.dashboard = False
            await self._leave(DASHBOARD_GROUP)

    async def events_batch(self, payload):
        """Committed events of one stream (chorus_site.events.broadcast_events); no database read
        unless a gap shows (catch-up from the log)."""
        if payload.get("group") == DASHBOARD_GROUP:
            # Summaries of every stream; those of a stream followed here come through its own group.
            events = [e for e in payload["events"] if e["stream"] not in self.positions]
            if self.dashboard and events:
                await self._send_events(DASHBOARD_GROUP, events)
            return
        stream = payload["stream"]
        position = self.positions.get(stream)
        if position is None:
            return
        fresh = [event async for event in accept_live(position, payload["events"])]
        if not fresh:
            return
        held = self.held.setdefault(stream, [])
        if all(event["kind"] in PROGRESS_KINDS for event in fresh):
            loop = asyncio.get_running_loop()
            due = self.last_frame_at.get(stream, float("-inf")) + COALESCE_S
            if held or loop.time() < due:
                if not held:  # the first held: its frame leaves when the interval is over
                    loop.call_later(max(0.0, due - loop.time()), self._deliver, {"type": "live.flush", "stream": stream})
                held.extend(fresh)
                return
        if not held and len(fresh) == len(payload["events"]):
            # The whole batch, as every watcher in this process sends it: encoded once for all.
            frames = payload.get("frames")
            if frames is None:
                frames = payload["frames"] = [json.dumps(frame) for frame in _frames(stream, fresh)]
            self.last_frame_at[stream] = asyncio.get_running_loop().time()
            for text in frames:
                await self.send(text_data=text)
            return
        await self._send_events(stream, [*held, *fresh])
        held.clear()

    async def live_flush(self, payload):
        stream = payload["stream"]
        held = self.held.get(stream)
        if held and stream in self.positions:
            await self._send_events(stream, list(held))
            held.clear()

    async def _send_events(self, stream: str, events: list[dict]):
        self.last_frame_at[stream] = asyncio.get_running_loop().time()
        for frame in _frames(stream, events):
            await self.send_json(frame)

    async def _error(self, code, message, stream=None):
        await self.send_json({"type": "error", "code": code, "message": message, "stream": stream})


def _frames(stream: str, events: list[dict]) -> list[dict]:
    """Runs of output as one ``events`` frame each; any other event as an ``event`` frame."""
    frames, run = [], []
    for event in [*events, None]:
        if event is not None and event["kind"] in PROGRESS_KINDS:
            run.append(event)
            continue
        if len(run) == 1:
            frames.append({"type": "event", "event": run[0]})
        elif run:
            frames.append({"type": "events", "stream": stream, "events": run})
        run = []
        if event is not None:
            frames.append({"type": "event", "event": event})
    return frames


def _fresh_user(user):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.filter(pk=user.pk, is_active=True).first()
