"""Following a stream live (SPEC §10), shared by the SSE routes and the WebSocket consumer.

The log is the truth and the channel layer only a wake-up: a live message is passed on when its
seq is exactly the next one of its stream; on any gap (a dropped message, a reconnect of the
layer) the follower reads the missing events from the log.  Hence no gap and no duplicate.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from .events import check_cursor, stream_group
from .layer_health import health, layer_call, receive_or_failure
from .models import Event, EventStream

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


async def accept_live(position: StreamPosition, message: dict):
    """Pass a live message on when it is the next of its stream, else fill the gap from the log."""
    if message["id"] <= position.last_id:
        return
    if message["seq"] == position.last_seq + 1:
        position.last_id, position.last_seq = message["id"], message["seq"]
        yield message
        return
    async for stored in catch_up(position):
        yield stored


async def follow(stream: str, cursor: int | None, *, heartbeat_s: float, poll_s: float = LOG_POLL_S):
    """Stored events after ``cursor`` then live ones; ``None`` is yielded when a heartbeat is due.

    The cursor is validated before anything is yielded, so callers can still answer 400/409/410.
    A heartbeat is due every ``heartbeat_s`` whatever the layer does.  While the channel layer is
    broken (Redis down, or restarted empty so the group is gone) the log is read every ``poll_s``
    and the group re-joined; once joined again the log is read once more, so nothing committed
    in between is missed and nothing is passed on twice (the position only moves forward).
    """
    layer = get_channel_layer()
    channel = await layer.new_channel()
    group = stream_group(stream)
    health.watch(layer)
    generation = health.generation
    # Subscribe first: nothing committed after this is missed.
    joined = await layer_call(layer.group_add(group, channel), "group_add")
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
                incoming, joined = await receive_or_failure(layer, channel, since=generation,
                                                           timeout=max(0.0, beat_at - loop.time()))
            else:
                await asyncio.sleep(max(0.0, min(poll_s, beat_at - loop.time())))
                generation = health.generation
                joined = await layer_call(layer.group_add(group, channel), "group_add")
            if incoming is not None:
                async for message in accept_live(position, incoming["event"]):
                    yield message
            else:
                # A quiet stream, a layer down or just back: whatever was dropped is in the log.
                async for message in catch_up(position):
                    yield message
            if loop.time() >= beat_at:
                yield None
                beat_at = loop.time() + heartbeat_s
    finally:
        await layer_call(layer.group_discard(group, channel), "group_discard", report=False)
