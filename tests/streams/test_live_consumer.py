"""/ws/live/ (SPEC §10): catch-up from a cursor then live, permission per subscribe, gap repair."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from chorus_site.consumers import LiveConsumer
from chorus_site.events import batch_message, event_append, stream_group
from chorus_site.models import Event
from sessions_app import services
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 5


@pytest.fixture(autouse=True)
async def _close_worker_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


async def connect(user):
    communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
    communicator.scope["user"] = user
    connected, _ = await communicator.connect(timeout=TIMEOUT)
    assert connected
    return communicator


async def receive_events(communicator, count):
    events = []
    while len(events) < count:
        message = await communicator.receive_json_from(timeout=TIMEOUT)
        if message["type"] == "event":
            events.append(message["event"])
    return events


async def test_subscribe_catches_up_then_follows_live(viewer):
    turn = await sync_to_async(factories.make_turn)()
    stream = f"session:{turn.session_id}"
    first = await sync_to_async(lambda: Event.objects.filter(stream=stream).order_by("id").first())()
    communicator = await connect(viewer)
    await communicator.send_json_to({"type": "subscribe", "stream": stream, "after": first.id})
    subscribed = await communicator.receive_json_from(timeout=TIMEOUT)
    assert subscribed == {"type": "subscribed", "stream": stream, "cursor": first.id}
    caught_up = await receive_events(communicator, 1)
    assert caught_up[0]["kind"] == "turn.created"
    await sync_to_async(services.turn_set_status)(turn_id=turn.pk, status="running")
    live = await receive_events(communicator, 1)
    assert live[0]["kind"] == "turn.status"
    assert live[0]["data"]["status"] == "running"
    assert live[0]["seq"] == caught_up[0]["seq"] + 1
    await communicator.disconnect()


async def test_a_dropped_live_message_is_filled_from_the_log(viewer):
    session = await sync_to_async(factories.make_session)()
    communicator = await connect(viewer)
    await communicator.send_json_to({"type": "subscribe", "stream": session.stream})
    await communicator.receive_json_from(timeout=TIMEOUT)
    # Two events are committed without a broadcast (as if the layer dropped them), then one with.
    await sync_to_async(event_append)(stream=session.stream, kind="test.dropped", data={"n": 1}, broadcast=False)
    await sync_to_async(event_append)(stream=session.stream, kind="test.dropped", data={"n": 2}, broadcast=False)
    await sync_to_async(event_append)(stream=session.stream, kind="test.live", data={"n": 3})
    events = await receive_events(communicator, 3)
    assert [e["data"]["n"] for e in events] == [1, 2, 3]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    await communicator.disconnect()


async def test_outsider_cannot_subscribe_and_receives_nothing(outsider):
    session = await sync_to_async(factories.make_session)()
    communicator = await connect(outsider)
    await communicator.send_json_to({"type": "subscribe", "stream": session.stream})
    answer = await communicator.receive_json_from(timeout=TIMEOUT)
    assert answer["type"] == "error" and answer["code"] == "not_found"
    await get_channel_layer().group_send(stream_group(session.stream), batch_message(session.stream, [{
        "id": 10**12, "stream": session.stream, "seq": 1, "kind": "x", "data": {}, "actor": "", "at": ""}]))
    assert await communicator.receive_nothing(timeout=0.5)
    await communicator.disconnect()


async def test_bad_subscriptions_are_refused_clearly(viewer):
    communicator = await connect(viewer)
    await communicator.send_json_to({"type": "subscribe", "stream": "session:not-a-uuid"})
    assert (await communicator.receive_json_from(timeout=TIMEOUT))["code"] == "bad_request"
    session = await sync_to_async(factories.make_session)()
    await communicator.send_json_to({"type": "subscribe", "stream": session.stream, "after": "x1"})
    assert (await communicator.receive_json_from(timeout=TIMEOUT))["code"] == "cursor_invalid"
    await communicator.disconnect()


async def test_anonymous_is_closed():
    from django.contrib.auth.models import AnonymousUser

    communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
    communicator.scope["user"] = AnonymousUser()
    connected, code = await communicator.connect(timeout=TIMEOUT)
    assert not connected
    assert code == 4401
