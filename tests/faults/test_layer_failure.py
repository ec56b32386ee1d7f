"""Issue 7 item 7 at the consumer level: a channel layer on a Redis of the test's own, which dies.

* ``/ws/live/`` closes with a close frame (4503) when its layer breaks, and a new socket resumes
  from the cursor: no event lost, none twice.
* The daemon's consumer keeps serving while Redis is down (its heartbeat lands in the database)
  and is woken through the layer again once Redis is back.
* An SSE follower keeps its heartbeat and delivers from the log while Redis is down.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import override_settings
from django.utils import timezone

from agents import protocol
from chorus_site.consumers import LiveConsumer
from chorus_site.events import event_append
from chorus_site.layer_health import LAYER_LOST_CLOSE, health
from chorus_site.live import follow
from chorus_site.settings import _layer_redis
from sessions_app import bridge, services
from sessions_app.consumers import DaemonConsumer
from sessions_app.models import Connection
from tests import factories

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]
TIMEOUT = 10


@pytest.fixture
def layer_on_own_redis(own_redis):
    """The channel layer of this process on ``own_redis``, with the production connection options."""
    layers = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                          "CONFIG": {"hosts": [_layer_redis(own_redis.url)], "capacity": 1000, "expiry": 30}}}
    with override_settings(CHANNEL_LAYERS=layers):
        yield own_redis


@pytest.fixture(autouse=True)
async def _close_worker_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


async def until(predicate, message: str, timeout: float = TIMEOUT):
    """Wait for ``predicate()`` (plain or awaitable) to be true, with a deadline."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {message}")


async def live_socket(user, stream: str, after: int):
    communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
    communicator.scope["user"] = user
    connected, _ = await communicator.connect(timeout=TIMEOUT)
    assert connected
    await communicator.send_json_to({"type": "subscribe", "stream": stream, "after": after})
    return communicator


async def read_until_closed(communicator, seen: list[int]):
    """Collect event ids until the socket closes; return the close code."""
    while True:
        message = await communicator.receive_output(timeout=TIMEOUT)
        if message["type"] == "websocket.close":
            return message.get("code")
        if message["type"] == "websocket.send":
            frame = json.loads(message["text"])
            if frame["type"] == "event":
                seen.append(frame["event"]["id"])


async def test_live_socket_closes_when_redis_dies_and_a_new_one_resumes_from_its_cursor(layer_on_own_redis, viewer):
    redis = layer_on_own_redis
    session = await sync_to_async(factories.make_session)()
    append = sync_to_async(event_append)
    seen: list[int] = []
    communicator = await live_socket(viewer, session.stream, after=0)
    first = await append(stream=session.stream, kind="test.n", data={"n": 1})
    reading = asyncio.ensure_future(read_until_closed(communicator, seen))
    await until(lambda: (first.id in seen), "the first event live")

    await sync_to_async(redis.kill)()
    code = await asyncio.wait_for(reading, timeout=TIMEOUT)
    assert code == LAYER_LOST_CLOSE  # a close frame, not a socket left open and deaf
    # Written while Redis is down (the broadcast fails quietly), then Redis comes back empty.
    during = await append(stream=session.stream, kind="test.n", data={"n": 2})
    await sync_to_async(redis.start)()
    await communicator.disconnect()

    again = await live_socket(viewer, session.stream, after=seen[-1])
    after = await append(stream=session.stream, kind="test.n", data={"n": 3})
    reading = asyncio.ensure_future(read_until_closed(again, seen))
    await until(lambda: (after.id in seen), "the event written after the restart, live")
    reading.cancel()
    await again.disconnect()
    stored = await sync_to_async(lambda: list(
        type(first).objects.filter(stream=session.stream).order_by("id").values_list("id", flat=True)))()
    assert during.id in seen
    assert stored == seen  # every event once, in order


async def test_live_socket_closes_when_redis_loses_its_data_without_any_error(layer_on_own_redis, viewer):
    """FLUSHALL (or a restart between two reads): no call fails, yet every group is gone."""
    redis = layer_on_own_redis
    session = await sync_to_async(factories.make_session)()
    seen: list[int] = []
    communicator = await live_socket(viewer, session.stream, after=0)
    first = await sync_to_async(event_append)(stream=session.stream, kind="test.n", data={"n": 1})
    reading = asyncio.ensure_future(read_until_closed(communicator, seen))
    await until(lambda: first.id in seen, "the first event live")
    await sync_to_async(redis.client().flushall)()
    code = await asyncio.wait_for(reading, timeout=TIMEOUT)
    assert code == LAYER_LOST_CLOSE
    await communicator.disconnect()


async def test_daemon_consumer_keeps_serving_while_redis_is_down_and_is_woken_again_after(layer_on_own_redis):
    redis = layer_on_own_redis
    connection, key = await sync_to_async(services.connection_register)(name="layer-daemon", backend="scripted",
                                                                        cwds=["/tmp"])
    communicator = WebsocketCommunicator(DaemonConsumer.as_asgi(), "/ws/daemon/",
                                         headers=[(b"authorization", f"Bearer {key}".encode())])
    connected, _ = await communicator.connect(timeout=TIMEOUT)
    assert connected
    welcome = await communicator.receive_json_from(timeout=TIMEOUT)
    assert welcome["type"] == protocol.WELCOME

    generation = health.generation
    await sync_to_async(redis.kill)()
    # The consumer's layer receive fails now; its socket must still be served from the database.
    await until(lambda: health.generation > generation, "the broken layer to be noticed")
    before = timezone.now()
    await communicator.send_json_to({"type": protocol.HEARTBEAT})

    async def heartbeat_landed():
        beat = await sync_to_async(lambda: Connection.objects.get(pk=connection.pk).last_heartbeat_at)()
        return beat is not None and beat >= before

    await until(heartbeat_landed, "the heartbeat sent while Redis is down to land")
    assert await communicator.receive_nothing(timeout=0.2)  # not closed

    await sync_to_async(redis.start)()
    # Once Redis is back (empty) the consumer re-joins its group, so pushes reach it again.
    group_key = f"{get_channel_layer().prefix}:group:{bridge.daemon_group(connection.pk)}"
    await until(lambda: redis.client().zcard(group_key) == 1, "the daemon consumer to re-join its group")
    assert await communicator.receive_nothing(timeout=0.2)
    await communicator.disconnect()


async def test_sse_follower_keeps_heartbeat_and_log_delivery_while_redis_is_down(layer_on_own_redis):
    redis = layer_on_own_redis
    session = await sync_to_async(factories.make_session)()
    append = sync_to_async(event_append)
    follower = follow(session.stream, 0, heartbeat_s=0.5, poll_s=0.2)
    assert await follower.__anext__() == "ready"
    got: list = []

    async def pump():
        async for message in follower:
            got.append(message)

    task = asyncio.ensure_future(pump())
    try:
        await sync_to_async(redis.kill)()
        during = await append(stream=session.stream, kind="test.n", data={"n": 1})
        await until(lambda: (any(isinstance(m, dict) and m["id"] == during.id for m in got)),
                    "an event written while Redis is down, from the log")
        beats = sum(1 for m in got if m is None)
        await until(lambda: (sum(1 for m in got if m is None) >= beats + 2),
                    "heartbeats while Redis is down")
        await sync_to_async(redis.start)()
        after = await append(stream=session.stream, kind="test.n", data={"n": 2})
        await until(lambda: (any(isinstance(m, dict) and m["id"] == after.id for m in got)),
                    "an event written after the restart")
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await follower.aclose()
    ids = [m["id"] for m in got if isinstance(m, dict)]
    assert len(ids) == len(set(ids)) and ids == sorted(ids)
