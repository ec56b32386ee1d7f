"""Following a stream live (SPEC §10), shared by the SSE routes and the WebSocket consumer.

The log is the truth and the channel layer only a wake-up: a live message is passed on when its
seq is exactly the next one of its stream; on any gap (a dropped message, a reconnect of the
layer) the follower reads the missing events from the log.  Hence no gap and no duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from .events import check_cursor, stream_group
from .layer_health import health, layer_call, receive_or_failure
from .models import Event, EventStream

log = logging.getLogger(__name__)

CATCH_UP_BATCH = 500
# While the channel layer is unavailable, an SSE stream reads the log by cursor this often.
LOG_POLL_S = 1.0


@dataclass
class StreamPosition:
    stream: str
    last_id: int
    last_seq: int


def _position_at(stream: str, cursor: int | None) -> StreamPosition:
    """Validate ``cursor`` (None → the stream's current head) and return where following starts."""
    if cursor is None:
        head = EventStream.objects.filter(name=stream).values_list("last_event_id", "last_seq").first()
        last_id, last_seq = head or (0, 0)
        return StreamPosition(stream, last_id, last_seq)
    check_cursor(stream, cursor)
    if cursor == 0:
        return StreamPosition(stream, 0, 0)
    seq = Event.objects.filter(pk=cursor).values_list("seq", flat=True).first()
    return StreamPosition(stream, cursor, seq or 0)


def _read_after(position: StreamPosition) -> list[dict]:
    rows = Event.objects.filter(stream=position.stream, id__gt=position.last_id).order_by("id")[:CATCH_UP_BATCH]
    return [event.as_message() for event in rows]


position_at = database_sync_to_async(_position_at)
read_after = database_sync_to_async(_read_after)


async def catch_up(position: StreamPosition):
    """Yield every stored event after ``position``, advancing it."""
    while True:
        batch = await read_after(position)
        for message in batch:
            position.last_id, position.last_seq = message["id"], message["seq"]
            yield message
        if len(batch) < CATCH_UP_BATCH:
            return


async def accept_live(position: StreamPosition, messages: list[dict]):
    """Pass on the live messages (one batch of a stream, oldest first) that are the next of their
    stream; on a gap fill it from the log (the only database read, once per gap)."""
    for index, message in enumerate(messages):
        if message["id"] <= position.last_id:
            continue
        if message["seq"] == position.last_seq + 1:
            position.last_id, position.last_seq = message["id"], message["seq"]
            yield message
            continue
        async for stored in catch_up(position):  # it reads the rest of this batch too
            yield stored
        return


class LocalFanout:
    """One channel-layer channel per process (per event loop) for every follower in it (issue 9).

    A channel-layer group holds each member channel, so a group message is copied into Redis and
    received once per member: with 200 watchers of one session, 200 copies per change.  Followers
    join here instead: the process joins each group once, receives each message once and hands it
    to its local followers (``deliver`` callbacks, which must not block).  A follower learns of a
    broken layer as before (``health``), and joins again; memberships are then forgotten here too.
    """

    def __init__(self, layer):
        self.layer = layer
        self.channel: str | None = None
        self.members: dict[str, dict[object, object]] = {}   # group -> {token: deliver}
        self.joining: dict[str, asyncio.Future] = {}
        self.generation = health.generation
        self.pump: asyncio.Task | None = None

    async def join(self, group: str, token, deliver) -> bool:
        """Deliver the group's messages to ``deliver`` from now on; False when the layer failed."""
        if self.generation != health.generation:
            self._reset()
        if self.channel is None:
            self.channel = await self.layer.new_channel()
        if self.pump is None or self.pump.done():
            self.pump = asyncio.get_running_loop().create_task(self._pump(self.channel, self.generation),
                                                               name="chorus-live-fanout")
        members = self.members.get(group)
        if members is None:
            pending = self.joining.get(group)
            if pending is None:
                pending = self.joining[group] = asyncio.ensure_future(
                    layer_call(self.layer.group_add(group, self.channel), "group_add"))
                pending.add_done_callback(lambda _f, g=group: self.joining.pop(g, None))
            # Wait for the membership itself (shield: one joiner cancelled does not cancel it for all).
            if not await asyncio.shield(pending):
                return False
            members = self.members.setdefault(group, {})
        members[token] = deliver
        return True

    async def leave(self, group: str, token) -> None:
        members = self.members.get(group)
        if members is None or members.pop(token, None) is None or members:
            return
        del self.members[group]
        if self.channel is not None:
            await layer_call(self.layer.group_discard(group, self.channel), "group_discard", report=False)

    def _reset(self) -> None:
        """The layer failed since the memberships were made: they may be gone in Redis."""
        if self.pump is not None:
            self.pump.cancel()
        self.channel, self.pump = None, None
        self.members.clear()
        self.generation = health.generation

    async def _pump(self, channel: str, generation: int) -> None:
        while True:
            message, ok = await receive_or_failure(self.layer, channel, since=generation)
            if not ok:
                return  # every follower learns it through ``health``; the next join starts afresh
            if message is None or channel != self.channel:
                continue
            for deliver in list(self.members.get(message.get("group"), {}).values()):
                try:
                    deliver(message)
                except Exception:  # noqa: BLE001 — one follower's failure is not the others'
                    log.exception("live delivery failed")


_fanouts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # event loop -> LocalFanout


def local_fanout(layer) -> LocalFanout:
    loop = asyncio.get_running_loop()
    fanout = _fanouts.get(loop)
    if fanout is None or fanout.layer is not layer:
        fanout = _fanouts[loop] = LocalFanout(layer)
    return fanout


# A follower's queue of live batches; a follower that falls this far behind drops the newest and
# reads them from the log (a gap is seen by seq), so a slow reader never holds memory unbounded.
FOLLOWER_QUEUE_MAX = 1000


class LiveInbox:
    """What a follower receives from the process' fan-out: batches, in order, bounded."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=FOLLOWER_QUEUE_MAX)
        self.dropped = 0

    def deliver(self, message: dict) -> None:
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.dropped += 1  # the gap is filled from the log by the next batch that arrives


async def follow(stream: str, cursor: int | None, *, heartbeat_s: float, poll_s: float = LOG_POLL_S):
    """Stored events after ``cursor`` then live ones; ``None`` is yielded when a heartbeat is due.

    The cursor is validated before anything is yielded, so callers can still answer 400/409/410.
    A heartbeat is due every ``heartbeat_s`` whatever the layer does.  While the channel layer is
    broken (Redis down, or restarted empty so the group is gone) the log is read every ``poll_s``
    and the group re-joined; once joined again the log is read once more, so nothing committed
    in between is missed and nothing is passed on twice (the position only moves forward).
    Live messages come through the process' fan-out (``LocalFanout``): no layer channel of its own.
    """
    layer = get_channel_layer()
    fanout = local_fanout(layer)
    inbox = LiveInbox()
    group = stream_group(stream)
    health.watch(layer)
    generation = health.generation
    # Subscribe first: nothing committed after this is missed.
    joined = await fanout.join(group, inbox, inbox.deliver)
    try:
        position = await position_at(stream, cursor)
        yield "ready"
        async for message in catch_up(position):
            yield message
        loop = asyncio.get_running_loop()
        beat_at = loop.time() + heartbeat_s
        while True:
            incoming = None
            if joined:
                incoming, joined = await _next_batch(inbox, since=generation,
                                                     timeout=max(0.0, beat_at - loop.time()))
            else:
                await asyncio.sleep(max(0.0, min(poll_s, beat_at - loop.time())))
                generation = health.generation
                joined = await fanout.join(group, inbox, inbox.deliver)
            if incoming is not None:
                async for message in accept_live(position, incoming["events"]):
                    yield message
            else:
                # A quiet stream, a layer down or just back: whatever was dropped is in the log.
                async for message in catch_up(position):
                    yield message
            if loop.time() >= beat_at:
                yield None
                beat_at = loop.time() + heartbeat_s
    finally:
        await fanout.leave(group, inbox)


async def _next_batch(inbox: LiveInbox, *, since: int, timeout: float):
    """``(batch, ok)`` as ``receive_or_failure``: a batch (None on timeout), ``ok`` False once the
    layer has failed since ``since``."""
    if health.generation != since:
        return None, False
    if not inbox.queue.empty():
        return inbox.queue.get_nowait(), True
    getting = asyncio.ensure_future(inbox.queue.get())
    changed = health.changed()
    try:
        await asyncio.wait({getting, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        changed.cancel()
        if not getting.done():
            getting.cancel()
    if getting.done() and not getting.cancelled():
        return getting.result(), health.generation == since
    return None, health.generation == since
