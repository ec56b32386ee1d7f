"""A second ``/ws/daemon/`` socket with the same key (issue 8 item 9).

Reproduction: a daemon reconnected (or a second daemon started with the same key) while the first
socket was still open; when the old socket closed, it marked the live connection offline.  Now the
newest socket speaks for the connection explicitly: the old one is told and closed, and its close
changes nothing.
"""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from agents import protocol
from chorus_site.models import Event
from sessions_app.models import Connection
from tests import factories

from .test_bridge_and_actions import online
from .test_daemon_validation import TIMEOUT, _close_worker_thread_connections, daemon_socket, next_of_type  # noqa: F401


def status_of(connection):
    return Connection.objects.get(pk=connection.pk).status


@pytest.mark.django_db(transaction=True)
async def test_the_newer_socket_replaces_the_older_and_its_close_keeps_the_connection_online(
        _close_worker_thread_connections):  # noqa: F811
    connection = await sync_to_async(lambda: online(factories.make_connection(cwds=["/srv/work"])))()
    first = await daemon_socket(connection)
    await first.send_json_to({"type": "hello", "version": "t", "cwds": ["/srv/work"]})
    second = await daemon_socket(connection)

    # The old socket is told why and closed with the replaced code.
    error = await next_of_type(first, protocol.ERROR)
    assert error["code"] == "replaced"
    closed = await first.receive_output(timeout=TIMEOUT)
    while closed["type"] != "websocket.close":
        closed = await first.receive_output(timeout=TIMEOUT)
    assert closed["code"] == protocol.SOCKET_REPLACED_CLOSE
    await first.wait(timeout=TIMEOUT)  # its disconnect handler has run

    assert await sync_to_async(status_of)(connection) == "online"
    replaced = await sync_to_async(lambda: Event.objects.filter(
        stream=f"connection:{connection.pk}", kind="connection.socket_replaced").count())()
    assert replaced == 1

    # The current socket is still served, and its own close does take presence down.
    await second.send_json_to({"type": "heartbeat"})
    await second.send_to(text_data="{}")
    assert (await next_of_type(second, protocol.ERROR))["code"] == "bad_request"
    await second.disconnect()
    assert await sync_to_async(status_of)(connection) == "offline"
