"""SSE streams (SPEC §10): exact replay after a cursor, then live; 400 / 409 / 410 cursors."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient
from django.utils import timezone

from chorus_site.events import event_append, events_purge_expired
from chorus_site.models import Event
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)

DEADLINE_S = 10


@pytest.fixture(autouse=True)
async def _close_worker_thread_connections():
    """sync_to_async runs ORM code in a worker thread whose connection must not outlive the test."""
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


def parse_frames(text: str) -> list[dict]:
    frames = []
    for block in text.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if line.startswith(":"):
                continue
            key, _, value = line.partition(": ")
            fields[key] = value
        if "id" in fields:
            frames.append(fields)
    return frames


async def read_frames(response, count: int) -> list[dict]:
    """Read the stream until ``count`` event frames arrived (deadline-bound)."""
    buffer = ""
    iterator = response.streaming_content.__aiter__()

    async def pump():
        nonlocal buffer
        while len(parse_frames(buffer)) < count:
            chunk = await iterator.__anext__()
            buffer += chunk.decode() if isinstance(chunk, bytes) else chunk

    try:
        await asyncio.wait_for(pump(), timeout=DEADLINE_S)
    finally:
        await iterator.aclose()
    return parse_frames(buffer)


def _session_with_events(n: int):
    session = factories.make_session()
    for i in range(n):
        event_append(stream=session.stream, kind="test.tick", data={"i": i})
    return session, list(Event.objects.filter(stream=session.stream).order_by("id"))


async def _client(user):
    client = AsyncClient()
    await sync_to_async(client.force_login)(user)
    return client


async def test_replays_exactly_the_events_after_last_event_id_then_live(viewer):
    session, events = await sync_to_async(_session_with_events)(5)
    client = await _client(viewer)
    cursor = events[2].id
    response = await client.get(f"/api/v1/sessions/{session.pk}/events/stream", headers={"Last-Event-ID": str(cursor)})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/event-stream")

    async def append_live():
        await asyncio.sleep(0)  # let the reader start
        await sync_to_async(event_append)(stream=session.stream, kind="test.live", data={"i": "live"})

    writer = asyncio.create_task(append_live())
    frames = await read_frames(response, len(events) - 3 + 1)
    await writer
    expected = [str(e.id) for e in events[3:]]
    assert [f["id"] for f in frames[:-1]] == expected
    assert frames[-1]["event"] == "test.live"
    assert len({f["id"] for f in frames}) == len(frames)  # no duplicate


async def test_last_event_id_wins_over_after(viewer):
    session, events = await sync_to_async(_session_with_events)(4)
    client = await _client(viewer)
    response = await client.get(f"/api/v1/sessions/{session.pk}/events/stream?after={events[0].id}",
                                headers={"Last-Event-ID": str(events[2].id)})
    frames = await read_frames(response, 1)
    assert frames[0]["id"] == str(events[3].id)


async def test_cursor_errors(viewer):
    session, events = await sync_to_async(_session_with_events)(3)
    other, other_events = await sync_to_async(_session_with_events)(1)
    client = await _client(viewer)
    url = f"/api/v1/sessions/{session.pk}/events/stream"
    malformed = await client.get(url + "?after=abc")
    assert malformed.status_code == 400
    foreign = await client.get(url, headers={"Last-Event-ID": str(other_events[0].id)})
    assert foreign.status_code == 400
    ahead = await client.get(url + f"?after={other_events[0].id + 1000}")
    assert ahead.status_code == 409
    assert ahead.json()["error"]["code"] == "cursor_ahead"


async def test_cursor_older_than_retention_is_410(viewer):
    def arrange():
        session, events = _session_with_events(4)
        Event.objects.filter(pk__in=[e.pk for e in events[:2]]).update(at=timezone.now() - timedelta(days=30))
        assert events_purge_expired() >= 2
        return session, events

    session, events = await sync_to_async(arrange)()
    client = await _client(viewer)
    url = f"/api/v1/sessions/{session.pk}/events/stream"
    expired = await client.get(url, headers={"Last-Event-ID": str(events[0].id)})
    assert expired.status_code == 410
    assert expired.json()["error"]["code"] == "cursor_expired"
    fine = await client.get(url, headers={"Last-Event-ID": str(events[1].id)})
    assert fine.status_code == 200
    frames = await read_frames(fine, 2)
    assert [f["id"] for f in frames] == [str(events[2].id), str(events[3].id)]


async def test_outsider_and_anonymous_get_nothing(outsider):
    session, _ = await sync_to_async(_session_with_events)(1)
    url = f"/api/v1/sessions/{session.pk}/events/stream?after=0"
    assert (await AsyncClient().get(url)).status_code == 401
    client = await _client(outsider)
    assert (await client.get(url)).status_code == 404
