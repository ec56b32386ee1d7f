"""Liveness never depends on throughput (issue 9 item 2): a daemon's heartbeat is written while the
process' shared sync thread is busy and while an earlier frame of the same daemon is still being
handled; a frame of any kind counts as a sign of life for the stale sweep."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connection as db_connection, transaction
from django.utils import timezone

from agents import protocol
from sessions_app import bridge
from sessions_app.models import Connection, ControlCommand
from tests import factories

from .test_bridge_and_actions import online
from .test_daemon_validation import TIMEOUT, _close_worker_thread_connections, daemon_socket  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)
LONG_AGO = timedelta(minutes=10)


def off_shared_thread(fn):
    """The test's own reads: never on the shared sync thread these tests keep busy."""
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            db_connection.close()
    return sync_to_async(run, thread_sensitive=False)


async def heard_after(connection, moment, *, deadline=TIMEOUT) -> bool:
    """Wait (bounded) until the connection's last_heartbeat_at is later than ``moment``."""
    read = off_shared_thread(lambda: Connection.objects.get(pk=connection.pk).last_heartbeat_at)
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while loop.time() < end:
        if await read() > moment:
            return True
        await asyncio.sleep(0.02)
    return False


async def stale_connection():
    def make():
        connection = online(factories.make_connection(cwds=["/srv/work"]))
        Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now() - LONG_AGO)
        connection.last_heartbeat_at = Connection.objects.get(pk=connection.pk).last_heartbeat_at
        return connection  # keeps plain_key (the factory's)
    return await off_shared_thread(make)()


async def test_a_heartbeat_is_written_while_the_shared_sync_thread_is_busy(_close_worker_thread_connections):  # noqa: F811
    connection = await stale_connection()
    socket = await daemon_socket(connection)
    release = threading.Event()
    busy = asyncio.ensure_future(sync_to_async(release.wait, thread_sensitive=True)(30))
    try:
        before = connection.last_heartbeat_at
        await socket.send_json_to({"type": protocol.HEARTBEAT})
        assert await heard_after(connection, before)
    finally:
        release.set()
        await busy
    await socket.disconnect()


async def test_a_heartbeat_is_written_while_an_earlier_frame_is_still_being_handled(
        _close_worker_thread_connections):  # noqa: F811
    connection = await stale_connection()
    command = await off_shared_thread(bridge.command_send)(connection_id=connection.pk, action=protocol.PROBE)
    socket = await daemon_socket(connection)
    locked, release = threading.Event(), threading.Event()

    def hold_the_command_row():
        try:
            with transaction.atomic():
                ControlCommand.objects.select_for_update().get(pk=command.pk)
                locked.set()
                release.wait(30)
        finally:
            db_connection.close()

    holder = threading.Thread(target=hold_the_command_row)
    holder.start()
    try:
        assert await asyncio.to_thread(locked.wait, TIMEOUT)
        await socket.send_json_to({"type": protocol.ACK, "command": str(command.pk)})  # waits on the lock
        before = await off_shared_thread(lambda: Connection.objects.get(pk=connection.pk).last_heartbeat_at)()
        await socket.send_json_to({"type": protocol.HEARTBEAT})
        assert await heard_after(connection, before)
    finally:
        release.set()
        await asyncio.to_thread(holder.join)
    # The ack is then applied: nothing the daemon sent is lost for being behind the lock.
    read_state = off_shared_thread(lambda: ControlCommand.objects.get(pk=command.pk).state)
    loop = asyncio.get_running_loop()
    end = loop.time() + TIMEOUT
    while await read_state() != "acked" and loop.time() < end:
        await asyncio.sleep(0.02)
    assert await read_state() == "acked"
    await socket.disconnect()


async def test_a_frame_of_any_kind_counts_as_a_sign_of_life(_close_worker_thread_connections):  # noqa: F811
    connection = await stale_connection()
    socket = await daemon_socket(connection)
    await socket.send_json_to({"type": protocol.SNAPSHOT, "running": []})
    assert await heard_after(connection, connection.last_heartbeat_at)
    # An ack (no heartbeat, no snapshot) too, once the last write is older than SEEN_WRITE_S.
    await off_shared_thread(lambda: Connection.objects.filter(pk=connection.pk).update(
        last_heartbeat_at=timezone.now() - LONG_AGO))()
    from sessions_app import consumers

    stale = await off_shared_thread(lambda: Connection.objects.get(pk=connection.pk).last_heartbeat_at)()
    loop = asyncio.get_running_loop()
    end = loop.time() + TIMEOUT
    heard = False
    while not heard and loop.time() < end:  # acks of an unknown command: refused, but heard
        await socket.send_json_to({"type": protocol.ACK, "command": "00000000-0000-0000-0000-000000000000"})
        heard = await heard_after(connection, stale, deadline=consumers.SEEN_WRITE_S)
    assert heard
    await socket.disconnect()
