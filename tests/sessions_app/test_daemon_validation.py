"""Every daemon report and frame is validated before anything of it is stored (issue 7 item 13).

Reproductions: a wake_error with exit_code "3x" was accepted and then the turn's reads answered 500;
a wake_error without kind and a pid of 2**40 were 500s; an ack with a non-UUID command id or deeply
nested JSON closed the daemon's socket (1011) without an error frame.
"""

from __future__ import annotations

import json
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone

from agents import protocol
from chorus_site.errors import ApplicationError
from sessions_app import bridge
from sessions_app.consumers import DaemonConsumer
from sessions_app.models import Connection, Turn
from tests import factories

from .test_bridge_and_actions import api, daemon, online, report, start

TIMEOUT = 5


@pytest.fixture
def connection(db):
    return online(factories.make_connection(cwds=["/srv/work"]))


def reads_answer_200(operator, turn):
    client = api(operator)
    assert client.get(f"/api/v1/turns/{turn.pk}").status_code == 200
    assert client.get(f"/api/v1/sessions/{turn.session_id}/turns").status_code == 200


def assert_422(response):
    assert response.status_code == 422, response.content
    assert response.json()["error"]["code"] == "validation_error"


# ---------------------------------------------------------------- HTTP reports
@pytest.mark.django_db
@pytest.mark.parametrize("wake_error", [
    {"kind": "exited_nonzero", "summary": "x", "exit_code": "3x"},
    {"summary": "no kind"},
    {"kind": "no-such-kind"},
    {"kind": "exited_nonzero", "exit_code": 2**40},
    {"kind": "exited_nonzero", "unknown_field": 1},
], ids=["exit_code_3x", "no_kind", "unknown_kind", "exit_code_huge", "unknown_field"])
def test_a_malformed_wake_error_is_422_and_nothing_is_stored(operator, connection, wake_error):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    assert report(Client(), connection, turn, status="running", pid=4242).status_code == 200
    assert_422(report(Client(), connection, turn, status="interrupted", reason="crash", wake_error=wake_error))
    turn.refresh_from_db()
    assert turn.status == "running" and turn.wake_error is None
    reads_answer_200(operator, turn)
    # The daemon's next, valid report still lands.
    good = report(Client(), connection, turn, status="interrupted", reason="crash",
                  wake_error={"kind": "exited_nonzero", "exit_code": 3})
    assert good.status_code == 200
    turn.refresh_from_db()
    assert turn.wake_error["exit_code"] == 3
    reads_answer_200(operator, turn)


@pytest.mark.django_db
@pytest.mark.parametrize("body", [
    {"status": "running", "pid": 2**40},
    {"status": "running", "pid": -5},
    {"status": "no-such-status"},
    {"status": "ended", "usage": {"input": "many"}},
    {"status": "ended", "background_processes": [{"pid": "x"}]},
    {"status": "requires_action", "requires_action": {"kind": "confirmation", "items": "nope"}},
], ids=["pid_2_40", "pid_negative", "status", "usage", "background", "requires_action"])
def test_malformed_advance_reports_are_422(operator, connection, body):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    assert_422(report(Client(), connection, turn, **body))
    turn.refresh_from_db()
    assert turn.status == "pending" and turn.pid is None
    reads_answer_200(operator, turn)


@pytest.mark.django_db
def test_the_bridge_validates_what_it_is_given_too(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    with pytest.raises(ApplicationError) as refused:
        bridge.report_advance(connection=connection, turn_id=turn.pk,
                              report={"report_id": "r1", "status": "running", "pid": 2**40})
    assert refused.value.code == "validation_error" and refused.value.status == 422
    with pytest.raises(ApplicationError):
        bridge.report_events(connection=connection, turn_id=turn.pk, report={"report_id": "r2", "events": "x"})


@pytest.mark.django_db
def test_deeply_nested_report_json_is_refused_not_a_500(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    nested = '{"report_id": "r", "status": "ended", "changes": ' + "[" * 100000 + "]" * 100000 + "}"
    response = Client().post(f"/api/v1/daemon/turns/{turn.pk}/advance", data=nested,
                             content_type="application/json", **daemon(connection))
    assert response.status_code in (400, 422), response.status_code
    assert "error" in response.json()
    assert Turn.objects.get(pk=turn.pk).status == "pending"


@pytest.mark.django_db
def test_agent_event_data_is_nested_under_its_own_key(operator, connection):
    """The agent's ``id``/``type`` no longer overwrite the portal's keys (the event keeps its turn)."""
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    body = {"report_id": str(uuid.uuid4()), "events": [
        {"kind": "session", "data": {"id": "backend-session-1"}},
        {"kind": "tool", "data": {"name": "Bash", "type": "shadow", "input": "ls"}}]}
    response = Client().post(f"/api/v1/daemon/turns/{turn.pk}/events", data=json.dumps(body),
                             content_type="application/json", **daemon(connection))
    assert response.status_code == 200 and response.json()["accepted"] == 2
    stored = [e.data for e in factories.events_of(turn.stream, kind="turn.output")]
    assert [(d["id"], d["type"]) for d in stored] == [(str(turn.pk), "session"), (str(turn.pk), "tool")]
    assert stored[0]["data"] == {"id": "backend-session-1"}
    assert stored[1]["data"] == {"name": "Bash", "type": "shadow", "input": "ls"}


# ---------------------------------------------------------------- WebSocket frames
@pytest.fixture(autouse=False)
async def _close_worker_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


async def daemon_socket(connection):
    communicator = WebsocketCommunicator(
        DaemonConsumer.as_asgi(), protocol.DAEMON_WS_PATH,
        headers=[(b"authorization", f"Bearer {connection.plain_key}".encode())])
    connected, _ = await communicator.connect(timeout=TIMEOUT)
    assert connected
    welcome = await communicator.receive_json_from(timeout=TIMEOUT)
    assert welcome["type"] == protocol.WELCOME
    return communicator


async def next_of_type(communicator, kind):
    while True:
        message = await communicator.receive_json_from(timeout=TIMEOUT)
        if message["type"] == kind:
            return message


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("frame", [
    {"type": "ack", "command": "not-a-uuid"},
    {"type": "ack"},
    {"type": "result", "command": "nope", "result": {}},
    {"type": "snapshot", "running": [{"turn": "x", "session": "s", "pid": 2**40, "pgid": 1, "started_at": 0,
                                      "process_start_time": 0}]},
    {"type": "hello", "max_concurrency": "many"},
    {"type": "heartbeat", "spool": {"queued": -1}},
], ids=["ack_not_uuid", "ack_without_command", "result_not_uuid", "snapshot_pid", "hello", "heartbeat_spool"])
async def test_a_malformed_frame_gets_an_error_frame_and_the_socket_stays(frame, _close_worker_thread_connections):
    connection = await sync_to_async(lambda: online(factories.make_connection(cwds=["/srv/work"])))()
    before = await sync_to_async(lambda: Connection.objects.get(pk=connection.pk).last_snapshot)()
    communicator = await daemon_socket(connection)
    await communicator.send_to(text_data=json.dumps(frame))
    error = await next_of_type(communicator, protocol.ERROR)
    assert error["code"] == "validation_error" and error["detail"]["errors"]
    assert await sync_to_async(lambda: Connection.objects.get(pk=connection.pk).last_snapshot)() == before
    # Still served: a valid heartbeat with spool health lands.
    await communicator.send_json_to({"type": "heartbeat", "spool": {"queued": 2, "parked": 1}})
    await communicator.send_to(text_data=json.dumps({"type": "ack"}))  # a later error proves the order
    await next_of_type(communicator, protocol.ERROR)
    stored = await sync_to_async(lambda: Connection.objects.get(pk=connection.pk).capabilities)()
    assert stored["spool"]["queued"] == 2 and stored["spool"]["parked"] == 1
    await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_deeply_nested_frame_gets_an_error_frame(_close_worker_thread_connections):
    connection = await sync_to_async(lambda: online(factories.make_connection(cwds=["/srv/work"])))()
    communicator = await daemon_socket(connection)
    await communicator.send_to(text_data='{"type": "ack", "command": ' + "[" * 100000 + "]" * 100000 + "}")
    error = await next_of_type(communicator, protocol.ERROR)
    assert error["code"] == "bad_request"
    await communicator.send_json_to({"type": "heartbeat"})
    await communicator.send_to(text_data="{}")
    assert (await next_of_type(communicator, protocol.ERROR))["code"] == "bad_request"
    heartbeat = await sync_to_async(lambda: Connection.objects.get(pk=connection.pk).last_heartbeat_at)()
    assert heartbeat is not None and (timezone.now() - heartbeat).total_seconds() < 60
    await communicator.disconnect()
