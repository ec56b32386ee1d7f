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
from .models import Event, EventStream

CATCH_UP_BATCH = 500


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


async def follow(stream: str, cursor: int | None, *, heartbeat_s: float):
    """Stored events after ``cursor`` then live ones; ``None`` is yielded when a heartbeat is due.

    The cursor is validated before anything is yielded, so callers can still answer 400/409/410.
    """
    layer = get_channel_layer()
    channel = await layer.new_channel()
    group = stream_group(stream)
    await layer.group_add(group, channel)  # subscribe first: nothing committed after this is missed
    try:
        position = await position_at(stream, cursor)
        yield "ready"
        async for message in catch_up(position):
            yield message
        while True:
            try:
                incoming = await asyncio.wait_for(layer.receive(channel), timeout=heartbeat_s)
            except asyncio.TimeoutError:
                # A quiet stream may also mean a dropped message: look at the log before the heartbeat.
                async for message in catch_up(position):
                    yield message
                yield None
                continue
            async for message in accept_live(position, incoming["event"]):
                yield message
    finally:
        await layer.group_discard(group, channel)
