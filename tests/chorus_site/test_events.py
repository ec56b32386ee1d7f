"""The event log (SPEC §3.3, §10): per-stream seq, cursors, retention, broadcast after commit."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection as db_connection
from django.db import transaction
from django.utils import timezone

from chorus_site.errors import ApplicationError
from chorus_site.events import (
    check_cursor,
    event_append,
    events_after,
    events_purge_expired,
    parse_cursor,
    stream_group,
)
from chorus_site.models import Event, EventStream


def new_stream(kind: str = "session") -> str:
    return f"{kind}:{uuid.uuid4()}"


def append(stream, count, kind="test.event"):
    return [event_append(stream=stream, kind=kind, data={"n": n}) for n in range(count)]


def refused(call) -> ApplicationError:
    with pytest.raises(ApplicationError) as error:
        call()
    return error.value


# ---------------------------------------------------------------- appending
@pytest.mark.django_db
def test_seq_is_contiguous_and_unique_per_stream():
    a, b = new_stream(), new_stream("run")
    written = []
    for n in range(12):
        written.append(event_append(stream=a if n % 3 else b, kind="k", data={"n": n}))
    for stream in (a, b):
        rows = list(Event.objects.filter(stream=stream).order_by("id").values_list("seq", flat=True))
        assert rows == list(range(1, len(rows) + 1))
    assert [e.id for e in written] == sorted(e.id for e in written)
    state = EventStream.objects.get(name=a)
    assert state.last_seq == 8
    assert state.last_event_id == written[-1].id
    assert not EventStream.objects.filter(name=new_stream()).exists()


@pytest.mark.django_db
def test_appended_event_carries_its_data():
    stream = new_stream()
    event = event_append(stream=stream, kind="turn.status", data={"status": "running"}, actor="alice")
    stored = Event.objects.get(pk=event.id)
    assert (stored.stream, stored.seq, stored.kind, stored.data, stored.actor) == (
        stream, 1, "turn.status", {"status": "running"}, "alice")
    assert stored.as_message()["id"] == event.id


@pytest.mark.django_db
def test_a_rolled_back_change_leaves_no_event_and_no_gap():
    stream = new_stream()
    append(stream, 2)
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            event_append(stream=stream, kind="k")
            raise RuntimeError("the change failed")
    append(stream, 1)
    assert list(Event.objects.filter(stream=stream).order_by("id").values_list("seq", flat=True)) == [1, 2, 3]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_to_one_stream_are_gapless():
    stream, other = new_stream(), new_stream()
    threads_count, per_thread = 8, 25
    barrier = threading.Barrier(threads_count)
    errors = []

    def worker(index):
        try:
            barrier.wait(timeout=30)
            for n in range(per_thread):
                with transaction.atomic():
                    event_append(stream=stream, kind="k", data={"t": index, "n": n}, broadcast=False)
                    if n % 5 == 0:
                        event_append(stream=other, kind="k", broadcast=False)
        except Exception as error:  # noqa: BLE001 - reported to the test
            errors.append(repr(error))
        finally:
            db_connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert errors == []
    rows = list(Event.objects.filter(stream=stream).order_by("id").values_list("seq", flat=True))
    assert rows == list(range(1, threads_count * per_thread + 1))  # ordered by id, so id order == seq order
    other_rows = list(Event.objects.filter(stream=other).order_by("id").values_list("seq", flat=True))
    assert other_rows == list(range(1, threads_count * 5 + 1))
    assert EventStream.objects.get(name=stream).last_seq == threads_count * per_thread
    assert EventStream.objects.get(name=stream).last_event_id == \
        Event.objects.filter(stream=stream).order_by("-id").first().id


# ---------------------------------------------------------------- reading after a cursor
@pytest.mark.django_db
def test_events_after_returns_exactly_the_later_events_in_order():
    stream, other = new_stream(), new_stream()
    events = []
    for n in range(10):
        events.append(event_append(stream=stream, kind="k", data={"n": n}))
        event_append(stream=other, kind="k")
    assert [e.id for e in events_after(stream, None)] == [e.id for e in events]
    assert [e.id for e in events_after(stream, 0)] == [e.id for e in events]
    for index, event in enumerate(events):
        assert [e.id for e in events_after(stream, event.id)] == [e.id for e in events[index + 1:]]
    assert [e.id for e in events_after(stream, events[2].id, limit=3)] == [e.id for e in events[3:6]]
    assert events_after(stream, events[-1].id) == []


@pytest.mark.django_db
def test_events_after_on_an_empty_stream():
    assert events_after(new_stream(), None) == []
    assert events_after(new_stream(), 0) == []


@pytest.mark.parametrize("raw,expected", [(None, None), ("", None), ("0", 0), ("42", 42), (" 42 ", 42), (7, 7),
                                          ("9223372036854775807", 9223372036854775807)])
def test_parse_cursor_accepts(raw, expected):
    assert parse_cursor(raw) == expected


@pytest.mark.parametrize("raw", ["abc", "-1", "+1", "1.5", "1e3", "0x10", "12 34", " ", "12abc", "²", "١٢", "１２",
                                 "1" * 20, "99999999999999999999999", "None", "\x00"])
def test_parse_cursor_rejects_malformed(raw):
    error = refused(lambda: parse_cursor(raw))
    assert (error.code, error.status) == ("cursor_invalid", 400)


@pytest.mark.django_db
def test_cursor_of_another_stream_is_invalid():
    stream, other = new_stream(), new_stream()
    append(stream, 3)
    foreign = append(other, 2)
    for cursor in (foreign[0].id, foreign[-1].id):
        error = refused(lambda: events_after(stream, cursor))
        assert (error.code, error.status) == ("cursor_invalid", 400)


@pytest.mark.django_db
def test_cursor_beyond_the_newest_event_is_ahead():
    stream = new_stream()
    events = append(stream, 3)
    for cursor in (events[-1].id + 1, events[-1].id + 10_000, 9223372036854775807):
        error = refused(lambda: check_cursor(stream, cursor))
        assert (error.code, error.status) == ("cursor_ahead", 409)
    # A cursor on a stream that has no event yet is ahead too.
    error = refused(lambda: check_cursor(new_stream(), events[-1].id))
    assert error.code in {"cursor_ahead", "cursor_invalid"}


@pytest.mark.django_db
def test_purged_cursors_expire_and_newer_ones_still_work():
    stream, untouched = new_stream(), new_stream()
    old = append(stream, 5)
    untouched_events = append(untouched, 2)
    recent = append(stream, 4)
    Event.objects.filter(id__in=[e.id for e in old]).update(at=timezone.now() - timedelta(days=30))

    assert events_purge_expired() == 5
    assert not Event.objects.filter(id__in=[e.id for e in old]).exists()
    assert EventStream.objects.get(name=stream).purged_through_id == old[-1].id

    for cursor in [0] + [e.id for e in old[:-1]]:
        error = refused(lambda: events_after(stream, cursor))
        assert (error.code, error.status) == ("cursor_expired", 410)
    # The newest purged event was seen by its holder: everything after it is still stored.
    assert [e.id for e in events_after(stream, old[-1].id)] == [e.id for e in recent]
    assert [e.id for e in events_after(stream, recent[0].id)] == [e.id for e in recent[1:]]
    assert events_after(stream, recent[-1].id) == []
    # Other streams are not affected.
    assert [e.id for e in events_after(untouched, None)] == [e.id for e in untouched_events]
    # Nothing more to purge.
    assert events_purge_expired() == 0


@pytest.mark.django_db
def test_purge_uses_the_retention_window_relative_to_now():
    stream = new_stream()
    events = append(stream, 3)
    retention = timedelta(days=settings.CHORUS_EVENT_RETENTION_DAYS)
    assert events_purge_expired(now=timezone.now() + retention - timedelta(minutes=5)) == 0
    assert events_purge_expired(now=timezone.now() + retention + timedelta(minutes=5)) == 3
    error = refused(lambda: events_after(stream, 0))
    assert error.code == "cursor_expired"
    # A new event after the purge is readable from the last purged cursor.
    fresh = event_append(stream=stream, kind="k")
    assert fresh.seq == 4
    assert [e.id for e in events_after(stream, events[-1].id)] == [fresh.id]


@pytest.mark.django_db
def test_purge_works_in_batches():
    stream = new_stream()
    append(stream, 7)
    Event.objects.filter(stream=stream).update(at=timezone.now() - timedelta(days=30))
    assert events_purge_expired(batch=3) == 7
    assert not Event.objects.filter(stream=stream).exists()


# ---------------------------------------------------------------- broadcast after commit (Redis)
# These run in sync_to_async's worker thread, which keeps its own database connection: close it,
# or the test database cannot be dropped at the end of the session.
def _append_committed(stream, **data):
    try:
        with transaction.atomic():
            return event_append(stream=stream, kind="k", data=data)
    finally:
        db_connection.close()


def _append_rolled_back(stream):
    try:
        with transaction.atomic():
            event_append(stream=stream, kind="k", data={"rolled": "back"})
            raise RuntimeError("abort")
    except RuntimeError:
        pass
    finally:
        db_connection.close()


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
async def test_event_is_broadcast_after_commit_and_not_when_rolled_back():
    layer = get_channel_layer()
    stream = new_stream()
    channel = await layer.new_channel()
    await layer.group_add(stream_group(stream), channel)
    try:
        await sync_to_async(_append_rolled_back)(stream)
        committed = await sync_to_async(_append_committed)(stream, n=1)
        message = await asyncio.wait_for(layer.receive(channel), timeout=10)
        # The first message to arrive is the committed event: the rolled-back one was never sent.
        assert message["type"] == "events.batch"
        assert [e["id"] for e in message["events"]] == [committed.id]
        assert message["stream"] == message["events"][0]["stream"] == stream
        assert message["events"][0]["data"] == {"n": 1}
    finally:
        await layer.group_discard(stream_group(stream), channel)


def test_stream_group_names_are_valid_channel_group_names():
    import re

    name = stream_group(f"session:{uuid.uuid4()}")
    assert re.fullmatch(r"[a-zA-Z0-9_.\-]{1,99}", name)
