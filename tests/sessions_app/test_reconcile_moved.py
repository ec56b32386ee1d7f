"""A turn settled offline is not reopened over the turn its moved session has sent elsewhere meanwhile
(found by tests/test_invariants_stateful.py): never two turns of one session running at once."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from sessions_app import actions, bridge
from sessions_app.models import Connection, ControlCommand, Turn
from tests import factories

pytestmark = pytest.mark.django_db

HELLO = {"version": "test", "backends": ["scripted"], "max_concurrency": 4}


def online(connection):
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    return connection


def report(connection, turn, **body):
    body.setdefault("report_id", str(uuid.uuid4()))
    return Client().post(f"/api/v1/daemon/turns/{turn.pk}/advance", data=json.dumps(body),
                         content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {connection.plain_key}")


def test_a_turn_settled_offline_is_not_reopened_over_the_turn_sent_after_the_move(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    b = online(factories.make_connection(cwds=["/srv/b"]))
    first = actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a", prompt="@sleep 60",
                                  idea_key="idea:moved-away")
    turn = Turn.objects.get(pk=first["turn"])
    assert report(a, turn, status="running", pid=4242).status_code == 200
    actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b", prompt="next", idea_key="idea:moved-away")
    # A goes away past the threshold: its turn is settled offline; a message sends the queued turn to B.
    Connection.objects.filter(pk=a.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    bridge.connection_daemon_disconnected(connection_id=a.pk)
    bridge.connections_sweep_stale()
    online(b)
    actions.session_message(actor=operator, session_id=turn.session_id, prompt="more")
    sent = Turn.objects.get(session=turn.session, status="pending")
    assert ControlCommand.objects.get(turn=sent, action="start_turn").connection_id == b.pk
    # A comes back holding its turn; then B starts the one it was sent.
    bridge.connection_daemon_connected(connection_id=a.pk, hello={**HELLO, "cwds": ["/srv/a"]})
    bridge.connection_store_snapshot(connection_id=a.pk, queued=[], running=[
        {"turn": str(turn.pk), "session": str(turn.session_id), "pid": 4242, "pgid": 4242, "started_at": 1.0,
         "process_start_time": 1.0}])
    report(b, sent, status="running", pid=777)
    running = Turn.objects.filter(session=turn.session, status__in=["running", "requires_action"])
    assert running.count() <= 1, list(running.values_list("seq", "connection_id"))
    # The one sent to B runs; A's stays settled (not reopened over it), its reports refused, not applied.
    assert list(running.values_list("pk", flat=True)) == [sent.pk]
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "offline")
    assert report(a, turn, status="ended", final_reply="late").status_code == 409


def test_interrupt_of_a_turn_whose_start_was_delivered_but_not_acked_asks_the_daemon(operator):
    """The daemon acks a start before it acts, and the ack may still be on its way (or lost with the
    link): a start that was delivered may already run.  The stop is confirmed by the daemon, never
    assumed (found by tests/test_invariants_stateful.py)."""
    a = online(factories.make_connection(cwds=["/srv/a"]))
    answer = actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a", prompt="@sleep 60")
    turn = Turn.objects.get(pk=answer["turn"])
    [start] = bridge.commands_to_deliver(connection_id=a.pk)  # delivered; the daemon starts the agent
    interrupted = actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    turn.refresh_from_db()
    assert turn.stop_state != "confirmed" and interrupted["dispatched"] is True
    interrupt = ControlCommand.objects.get(turn=turn, action="interrupt")
    assert interrupt.connection_id == a.pk
    # The daemon ran it: it stops it and says so.
    assert report(a, turn, status="running", pid=4242).status_code == 200
    assert report(a, turn, status="interrupted", reason="user", stop_state="confirmed").status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "user", "confirmed")


def test_a_delivered_start_the_daemon_never_got_settles_on_its_not_held(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    answer = actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a", prompt="@sleep 60")
    turn = Turn.objects.get(pk=answer["turn"])
    bridge.commands_to_deliver(connection_id=a.pk)  # delivered, but the link died before the daemon read it
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    interrupt = ControlCommand.objects.get(turn=turn, action="interrupt")
    bridge.command_result(connection_id=a.pk, command_id=interrupt.pk, result={"held": False})
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "user", "confirmed")
    assert ControlCommand.objects.get(turn=turn, action="start_turn").state == "expired"  # never started later
