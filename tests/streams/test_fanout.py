"""Fan-out that scales with watchers (issue 9 item 3), against the real Redis channel layer:
one group member per process whatever the number of watchers, delivery without the shared sync
thread (channels' per-handler ``aclose_old_connections``), output coalesced for browsers."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from chorus_site.consumers import LiveConsumer
from chorus_site.events import batch_message, stream_group
from chorus_site.live import position_at
from tests import factories
from tests.streams.test_live_consumer import TIMEOUT, connect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]
WATCHERS = 12


@pytest.fixture(autouse=True)
async def _close_worker_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


async def subscribed(user, stream):
    communicator = await connect(user)
    await communicator.send_json_to({"type": "subscribe", "stream": stream})
    answer = await communicator.receive_json_from(timeout=TIMEOUT)
    assert answer["type"] == "subscribed", answer
    return communicator


def live_event(stream, position, n, kind="turn.output"):
    return {"id": position.last_id + n, "stream": stream, "seq": position.last_seq + n, "kind": kind,
            "data": {"n": n}, "actor": "", "at": ""}


async def test_many_watchers_of_a_stream_are_one_member_of_its_group(viewer):
    session = await sync_to_async(factories.make_session)()
    layer = get_channel_layer()
    watchers = [await subscribed(viewer, session.stream) for _ in range(WATCHERS)]
    members = await layer.connection(0).zcard(layer._group_key(stream_group(session.stream)))
    assert members == 1  # the process' fan-out channel, not one per watcher
    position = await position_at(session.stream, None)
    await layer.group_send(stream_group(session.stream),
                           batch_message(session.stream, [live_event(session.stream, position, 1, "test.live")]))
    for watcher in watchers:
        frame = await watcher.receive_json_from(timeout=TIMEOUT)
        assert frame["type"] == "event" and frame["event"]["data"] == {"n": 1}
    for watcher in watchers:
        await watcher.disconnect()
    assert await layer.connection(0).zcard(layer._group_key(stream_group(session.stream))) == 0


async def test_a_live_event_is_delivered_while_the_shared_sync_thread_is_busy(viewer):
    """channels' dispatch ran ``close_old_connections`` on the one shared sync thread before every
    handler: a watcher's events waited behind whatever else used that thread."""
    session = await sync_to_async(factories.make_session)()
    watcher = await subscribed(viewer, session.stream)
    position = await position_at(session.stream, None)
    release = threading.Event()
    busy = asyncio.ensure_future(sync_to_async(release.wait, thread_sensitive=True)(30))
    try:
        await get_channel_layer().group_send(stream_group(session.stream), batch_message(
            session.stream, [live_event(session.stream, position, 1, "test.live")]))
        frame = await watcher.receive_json_from(timeout=TIMEOUT)
        assert frame["event"]["seq"] == position.last_seq + 1
    finally:
        release.set()
        await busy
    await watcher.disconnect()


async def test_output_bursts_are_coalesced_for_browsers_and_a_status_is_not_held(viewer):
    session = await sync_to_async(factories.make_session)()
    watcher = await subscribed(viewer, session.stream)
    position = await position_at(session.stream, None)
    layer = get_channel_layer()
    burst = 30
    for n in range(1, burst + 1):
        await layer.group_send(stream_group(session.stream),
                               batch_message(session.stream, [live_event(session.stream, position, n)]))
    await layer.group_send(stream_group(session.stream), batch_message(
        session.stream, [live_event(session.stream, position, burst + 1, "turn.status")]))
    frames, received = 0, []
    while len(received) < burst + 1:
        frame = await watcher.receive_json_from(timeout=TIMEOUT)
        frames += 1
        received += [frame["event"]] if frame["type"] == "event" else frame["events"]
    assert [e["data"]["n"] for e in received] == list(range(1, burst + 2))  # every event, in order
    assert received[-1]["kind"] == "turn.status"
    assert frames < burst  # the output came in a few frames, not one per event
    await watcher.disconnect()
