"""A daemon's events report is ingested as a batch (issue 9 item 1): one INSERT of its rows, one
sequence allocation of its stream and one channel-layer message carrying the whole batch, against
the real PostgreSQL and Redis layer."""

from __future__ import annotations

import json
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection as db_connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from chorus_site.events import DASHBOARD_GROUP, stream_group
from chorus_site.models import Event
from tests.sessions_app.test_bridge_and_actions import api, daemon, online, post, report
from tests import factories
from sessions_app.models import Turn

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]
EVENTS = 50


@pytest.fixture
def running_turn(operator):
    connection = online(factories.make_connection(cwds=["/srv/work"]))
    answer = post(api(operator), "/api/v1/sessions",
                  {"connection": str(connection.pk), "cwd": "/srv/work/app", "prompt": "@reply hi"})
    assert answer.status_code == 201, answer.content
    turn = Turn.objects.get(pk=answer.json()["turn"])
    assert report(Client(), connection, turn, status="running", pid=4242).status_code == 200
    return connection, turn


class CountingLayer:
    """The real layer's ``group_send``, counted per group (the call goes through to Redis)."""

    def __init__(self, layer):
        self.layer, self.original, self.sent = layer, layer.group_send, []

    async def group_send(self, group, message):
        self.sent.append((group, message))
        return await self.original(group, message)

    def __enter__(self):
        self.layer.group_send = self.group_send
        return self

    def __exit__(self, *exc):
        del self.layer.group_send  # the instance attribute: the class' method is back


def post_events(connection, turn, events):
    return Client().post(f"/api/v1/daemon/turns/{turn.pk}/events", content_type="application/json",
                         data=json.dumps({"report_id": str(uuid.uuid4()), "events": events}), **daemon(connection))


def test_a_report_of_n_events_is_one_insert_one_seq_allocation_and_one_group_message(running_turn):
    connection, turn = running_turn
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(stream_group(turn.stream), channel)
    events = [{"kind": "text", "data": {"text": f"line {i} of tests/agents_daemon/test_spool.py"}} for i in range(EVENTS)]
    before = Event.objects.filter(stream=turn.stream).count()
    with CountingLayer(layer) as counting, CaptureQueriesContext(db_connection) as queries:
        answer = post_events(connection, turn, events)
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"accepted": EVENTS, "skipped": 0}
    assert Event.objects.filter(stream=turn.stream).count() == before + EVENTS
    statements = [q["sql"] for q in queries.captured_queries]
    event_inserts = [sql for sql in statements if sql.startswith('INSERT INTO "chorus_site_event"')]
    seq_allocations = [sql for sql in statements if "chorus_site_eventstream" in sql and "last_seq" in sql
                       and sql.startswith("INSERT")]
    assert len(event_inserts) == 1
    assert len(seq_allocations) == 1
    # One message to the session's group with the whole batch; agent output is no dashboard summary.
    assert [group for group, _ in counting.sent] == [stream_group(turn.stream)]
    assert DASHBOARD_GROUP not in [group for group, _ in counting.sent]
    message = async_to_sync(layer.receive)(channel)
    assert message["type"] == "events.batch"
    assert [e["seq"] for e in message["events"]] == list(range(message["events"][0]["seq"],
                                                               message["events"][0]["seq"] + EVENTS))
    assert [e["data"]["data"]["text"] for e in message["events"]] == [e["data"]["text"] for e in events]
    async_to_sync(layer.group_discard)(stream_group(turn.stream), channel)


def test_a_status_change_is_one_message_to_its_stream_and_one_summary_to_the_dashboard(running_turn):
    connection, turn = running_turn
    with CountingLayer(get_channel_layer()) as counting:
        assert report(Client(), connection, turn, status="ended", final_reply="done").status_code == 200
    turn_stream = [m for g, m in counting.sent if g == stream_group(turn.stream)]
    summaries = [m for g, m in counting.sent if g == DASHBOARD_GROUP]
    assert len(turn_stream) == 1 and len(summaries) == 1
    assert "turn.status" in [e["kind"] for e in summaries[0]["events"]]
    assert "turn.output" not in [e["kind"] for e in summaries[0]["events"]]
