"""The event log (SPEC §3.3, §10): append in the transaction of the change, broadcast after commit.

Appending takes the stream's counter row lock before inserting, so within one stream both ``seq``
and ``id`` grow in commit order: a reader holding a cursor never misses an event of that stream.
Live delivery through the channel layer is only a wake-up; readers catch up from the log.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import timedelta

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from .errors import ApplicationError
from .models import Event, EventStream
from .redaction import redact_data

log = logging.getLogger(__name__)

DASHBOARD_GROUP = "dashboard"


def stream_group(stream: str) -> str:
    """Channel-layer group names allow only [a-zA-Z0-9-_.]."""
    return "stream." + stream.replace(":", ".")


def _next_seq(stream: str, count: int = 1) -> int:
    """Reserve ``count`` seqs of ``stream``; returns the last one.

    One statement on PostgreSQL and SQLite alike: create-or-increment, holding the row lock
    until commit, which orders concurrent appenders of the same stream.
    """
    table = EventStream._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (name, last_seq, last_event_id, purged_through_id) VALUES (%s, %s, 0, 0) "
            f"ON CONFLICT (name) DO UPDATE SET last_seq = {table}.last_seq + %s RETURNING last_seq",
            [stream, count, count],
        )
        return cursor.fetchone()[0]


def event_append(*, stream: str, kind: str, data: dict | None = None, actor: str = "", broadcast: bool = True) -> Event:
    """Append one event; must run inside the transaction of the change it records."""
    with transaction.atomic():
        seq = _next_seq(stream)
        event = Event.objects.create(
            stream=stream, seq=seq, kind=kind, data=data or {}, actor=actor or "", at=timezone.now()
        )
        EventStream.objects.filter(name=stream).update(last_event_id=event.id)
    if broadcast:
        messages = [event.as_message()]
        transaction.on_commit(lambda: broadcast_events(stream, messages))
    return event


def events_append_many(*, stream: str, items: list[dict], actor: str = "", redacted: bool = False) -> list[Event]:
    """Append a batch (``[{kind, data}]``) to one stream: one counter update, one INSERT, and one
    broadcast after commit carrying the whole batch (issue 9).

    The data comes from agents, so it is redacted before it is stored, unless the caller already
    did (``redacted``: the daemon report route redacts the whole report once, in order).
    """
    if not items:
        return []
    with transaction.atomic():
        last = _next_seq(stream, len(items))
        first = last - len(items) + 1
        now = timezone.now()
        events = Event.objects.bulk_create([
            Event(stream=stream, seq=first + i, kind=item["kind"],
                  data=(item.get("data") or {}) if redacted else redact_data(item.get("data") or {}),
                  actor=actor, at=now)
            for i, item in enumerate(items)
        ])
        EventStream.objects.filter(name=stream).update(last_event_id=events[-1].id)
    messages = [e.as_message() for e in events]
    transaction.on_commit(lambda: broadcast_events(stream, messages))
    return events


# A group message carries at most this many events; a larger batch leaves as several messages.
BROADCAST_EVENTS_MAX = 1000
# Agent output: the bulk of all events, and nothing a changelist or the dashboard shows.
OUTPUT_KINDS = frozenset({"turn.output"})


def is_summary(message: dict) -> bool:
    """An event the ``dashboard`` stream carries (changelists and the index re-read on it): every
    change of an object's state (turn.stalled / turn.unstalled included), not the agents' output
    (issue 9: that firehose went to every dashboard subscriber)."""
    return message["kind"] not in OUTPUT_KINDS


def batch_message(stream: str, messages: list[dict], group: str | None = None) -> dict:
    """The channel-layer message of committed events of one stream, oldest first (live.py follows);
    ``group``: the group it is sent to (the process' fan-out routes by it)."""
    return {"type": "events.batch", "stream": stream, "group": group or stream_group(stream), "events": messages}


def broadcast_events(stream: str, messages: list[dict]) -> None:
    """After commit: one group message per batch to the stream's group, and the summaries among
    them (state changes, not output) to the dashboard's."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _send(stream, messages)
        return
    # Sync code on a thread that hosts an event loop (async_to_sync refuses to run there):
    # send from a helper thread, and wait for it so events still leave in commit order.
    sender = threading.Thread(target=_send, args=(stream, messages), name="chorus-broadcast")
    sender.start()
    sender.join()


def _send(stream: str, messages: list[dict]) -> None:
    """Never raises: it runs after the commit, inside the request (or task) that made the change,
    whose answer must not turn into an error because Redis is down.  Bounded by the layer's
    socket timeouts (settings.CHANNEL_LAYERS); followers catch up from the log by cursor."""
    try:
        layer = get_channel_layer()
        if layer is None or not messages:
            return
        async_to_sync(_publish)(layer, stream, messages)
    except Exception:  # the log is the truth; a lost wake-up is caught up by cursor
        log.warning("broadcast of events %s..%s failed", messages[0]["id"], messages[-1]["id"], exc_info=True)


async def _publish(layer, stream: str, messages: list[dict]) -> None:
    group = stream_group(stream)
    for start in range(0, len(messages), BROADCAST_EVENTS_MAX):
        await layer.group_send(group, batch_message(stream, messages[start:start + BROADCAST_EVENTS_MAX]))
    summaries = [m for m in messages if is_summary(m)]
    if summaries:
        await layer.group_send(DASHBOARD_GROUP, batch_message(DASHBOARD_GROUP, summaries, DASHBOARD_GROUP))


def parse_cursor(raw) -> int | None:
    """None for absent; 400 ``cursor_invalid`` for anything but a non-negative integer."""
    if raw is None or raw == "":
        return None
    text = str(raw).strip()
    # isdigit() alone accepts '²' (int() then fails) and other scripts' digits ('١٢' → 12).
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise ApplicationError("cursor_invalid", f"cursor {str(raw)[:40]!r} is not a valid event cursor")
    return int(text)


def check_cursor(stream: str, cursor: int) -> None:
    """Raise the §10 errors for a cursor that cannot be resumed on ``stream``."""
    state = EventStream.objects.filter(name=stream).first()
    last_id = state.last_event_id if state else 0
    purged_through = state.purged_through_id if state else 0
    if cursor == 0:
        if purged_through:
            raise ApplicationError(
                "cursor_expired", "events of this stream from the beginning have passed retention; reload the snapshot",
                {"oldest_available_after": purged_through},
            )
        return
    owner = Event.objects.filter(pk=cursor).values_list("stream", flat=True).first()
    if owner is not None and owner != stream:
        raise ApplicationError("cursor_invalid", "cursor belongs to another stream", {"stream": stream})
    if owner is None:
        if cursor > last_id and cursor > (Event.objects.order_by("-id").values_list("id", flat=True).first() or 0):
            raise ApplicationError("cursor_ahead", "cursor is beyond the newest event", {"newest": last_id})
        if cursor == purged_through:
            return  # the newest purged event: the client has seen everything up to it
        if cursor < purged_through:
            raise ApplicationError(
                "cursor_expired", "cursor is older than the retention window; reload the snapshot",
                {"oldest_available_after": purged_through},
            )
        raise ApplicationError("cursor_invalid", "cursor does not belong to this stream", {"stream": stream})
    if cursor > last_id:
        raise ApplicationError("cursor_ahead", "cursor is beyond the newest event", {"newest": last_id})


def events_after(stream: str, cursor: int | None, *, limit: int = 500) -> list[Event]:
    """Stored events of ``stream`` after ``cursor`` (validated), oldest first."""
    if cursor is None:
        cursor = 0
    check_cursor(stream, cursor)
    return list(Event.objects.filter(stream=stream, id__gt=cursor).order_by("id")[:limit])


def events_purge_expired(*, now=None, batch: int = 10_000) -> int:
    """Delete events past retention, recording per stream how far it was purged."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.CHORUS_EVENT_RETENTION_DAYS)
    deleted = 0
    while True:
        with transaction.atomic():
            rows = list(Event.objects.filter(at__lt=cutoff).order_by("id").values_list("id", "stream")[:batch])
            if not rows:
                return deleted
            highest: dict[str, int] = {}
            for event_id, stream in rows:
                highest[stream] = max(highest.get(stream, 0), event_id)
            for stream, event_id in highest.items():
                EventStream.objects.filter(name=stream, purged_through_id__lt=event_id).update(
                    purged_through_id=event_id
                )
            deleted += Event.objects.filter(id__in=[r[0] for r in rows]).delete()[0]
