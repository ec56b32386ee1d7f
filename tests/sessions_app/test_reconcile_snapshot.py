"""The daemon's snapshot is the truth about the processes it holds (SPEC §11, §3.1 last_snapshot; issue 7
items 6, 8, 10): a turn the portal settled ``interrupted(offline)`` while its daemon was away, and that
the daemon still holds, is reopened (explicitly, audited); pending work the daemon does not hold is sent
again.  The portal side alone, against PostgreSQL; tests/faults/test_daemon_truth.py runs the whole stack."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from chorus_site.models import AuditEntry, Event
from sessions_app import actions, bridge
from sessions_app.models import Connection, ControlCommand, Turn
from tests import factories
from tests.sessions_app.test_bridge_and_actions import online, report as bridge_report

pytestmark = pytest.mark.django_db

HELLO = {"version": "test", "backends": ["scripted"], "cwds": ["/srv/work"], "max_concurrency": 4}


def report(connection, turn, **body):
    return bridge_report(Client(), connection, turn, **body)


def held(turn, pid=4242) -> dict:
    return {"turn": str(turn.pk), "session": str(turn.session_id), "pid": pid, "pgid": pid, "started_at": 1.0,
            "process_start_time": 1.0}


@pytest.fixture
def connection():
    return online(factories.make_connection(cwds=["/srv/work"]))


def start(connection, prompt="@sleep 60", idea_key=None) -> Turn:
    answer = actions.session_start(actor=None, connection_id=connection.pk, cwd="/srv/work", prompt=prompt,
                                   idea_key=idea_key, acknowledge_changes=True)
    return Turn.objects.get(pk=answer["turn"])


def running_then_swept(connection, **kwargs) -> Turn:
    """A turn its daemon runs, settled interrupted(offline) by the sweep while the daemon is away."""
    turn = start(connection, **kwargs)
    assert report(connection, turn, status="running", pid=4242).status_code == 200
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    bridge.connections_sweep_stale()
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "offline")
    return turn


def reconciled_events(turn):
    return list(Event.objects.filter(stream=turn.stream, kind="turn.reconciled", data__id=str(turn.pk)))


def test_a_turn_settled_offline_and_listed_in_the_daemons_snapshot_runs_again(connection):
    turn = running_then_swept(connection)
    bridge.connection_daemon_connected(connection_id=connection.pk, hello=HELLO)
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[held(turn)], queued=[])
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.ended_at) == ("running", "", None)
    [event] = reconciled_events(turn)
    assert event.data["from"] == "interrupted(offline)" and event.data["to"] == "running"
    assert event.data["evidence"]["basis"] == "snapshot" and event.data["evidence"]["pid"] == 4242
    assert event.data["evidence"]["connection"] == str(connection.pk)
    assert event.data["evidence"]["settled"]["interrupt_evidence"]["basis"] == "heartbeat_stale"
    assert AuditEntry.objects.filter(action="turn.reconcile", target=f"turn:{turn.pk}", actor="system").exists()
    # its end report is then accepted normally
    assert report(connection, turn, status="ended", final_reply="done after all").status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.final_reply) == ("ended", "done after all")
    # a second snapshot listing it changes nothing more
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[held(turn)], queued=[])
    assert len(reconciled_events(turn)) == 1


def test_the_end_report_of_a_turn_settled_offline_is_accepted_before_any_snapshot(connection):
    turn = running_then_swept(connection)
    online(connection)
    response = report(connection, turn, status="ended", final_reply="finished while you were away")
    assert response.status_code == 200, response.content
    turn.refresh_from_db()
    assert (turn.status, turn.final_reply) == ("ended", "finished while you were away")
    [event] = reconciled_events(turn)
    assert event.data["evidence"]["basis"] == "daemon_report"
    statuses = [e.data["status"] for e in Event.objects.filter(stream=turn.stream, kind="turn.status",
                                                                data__id=str(turn.pk)).order_by("id")]
    assert statuses[-3:] == ["interrupted", "running", "ended"]


def test_a_heartbeat_listing_the_turn_reopens_it(connection):
    # SIGSTOP'd daemon: its socket stays open, so no new hello or snapshot follows the freeze.
    turn = running_then_swept(connection)
    bridge.connection_heartbeat(connection_id=connection.pk, running=[str(turn.pk)])
    turn.refresh_from_db()
    assert turn.status == "running"
    assert reconciled_events(turn)[0].data["evidence"]["basis"] == "heartbeat"
    assert Connection.objects.get(pk=connection.pk).status == "online"


def test_only_the_daemon_that_ran_it_and_only_an_offline_verdict(connection):
    other = online(factories.make_connection(cwds=["/srv/work"]))
    turn = running_then_swept(connection)
    bridge.connection_store_snapshot(connection_id=other.pk, running=[held(turn)], queued=[])
    bridge.connection_heartbeat(connection_id=other.pk, running=[str(turn.pk), "not-a-uuid"])
    assert Turn.objects.get(pk=turn.pk).status == "interrupted"
    online(connection)
    user_stopped = start(connection, idea_key="idea:user")
    report(connection, user_stopped, status="running", pid=7)
    report(connection, user_stopped, status="interrupted", reason="user", stop_state="confirmed")
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[held(user_stopped)], queued=[])
    assert Turn.objects.get(pk=user_stopped.pk).status == "interrupted"
    assert not reconciled_events(turn) and not reconciled_events(user_stopped)


def test_no_reopen_while_another_turn_of_the_session_runs(connection):
    turn = running_then_swept(connection, idea_key="idea:busy")
    online(connection)
    later = Turn.objects.get(pk=actions.session_message(actor=None, session_id=turn.session_id, prompt="go on")["turn"])
    assert report(connection, later, status="running", pid=99).status_code == 200
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[held(turn), held(later, 99)], queued=[])
    assert Turn.objects.get(pk=turn.pk).status == "interrupted"
    assert Turn.objects.filter(session_id=turn.session_id, status="running").count() == 1


def test_interrupt_reaches_an_offline_settled_turn_its_daemon_says_it_holds(connection):
    turn = running_then_swept(connection)
    Connection.objects.filter(pk=connection.pk).update(
        last_snapshot={"at": timezone.now().isoformat(), "running": [held(turn)]})
    answer = actions.turn_interrupt(actor=None, turn_id=turn.pk)
    assert answer["changed"] is True and answer["dispatched"] is True
    turn.refresh_from_db()
    assert (turn.status, turn.stop_state) == ("running", "requested")
    assert ControlCommand.objects.filter(turn=turn, action="interrupt", connection=connection).exists()
    assert report(connection, turn, status="interrupted", reason="user", stop_state="confirmed").status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "user", "confirmed")


def test_a_turn_queued_behind_one_settled_offline_is_dispatched_when_the_daemon_is_back(connection):
    first = start(connection, idea_key="idea:queue")
    assert report(connection, first, status="running", pid=4242).status_code == 200
    waiting = Turn.objects.get(pk=actions.session_message(actor=None, session_id=first.session_id,
                                                          prompt="@reply next")["turn"])
    assert not ControlCommand.objects.filter(turn=waiting).exists()  # queued behind the running turn
    # The daemon has been away past the threshold, not past the pending grace (bridge.PENDING_GRACE_FACTOR).
    away = timedelta(seconds=settings.CHORUS_HEARTBEAT_TIMEOUT_S + 5)
    Turn.objects.filter(pk=waiting.pk).update(created_at=timezone.now() - away)
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now() - away)
    bridge.connections_sweep_stale()
    assert Turn.objects.get(pk=first.pk).interrupted_reason == "offline"
    assert Turn.objects.get(pk=waiting.pk).status == "pending"  # no process to lose: it waits longer
    bridge.connection_daemon_connected(connection_id=connection.pk, hello=HELLO)
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[], queued=[])
    command = ControlCommand.objects.get(turn=waiting)
    assert (command.action, command.connection_id) == ("start_turn", connection.pk)
    assert command.state in {"pending", "delivered"}


def test_a_start_acked_by_a_daemon_that_then_died_is_sent_again(connection):
    turn = start(connection, prompt="@reply lost", idea_key="idea:lost")
    lost = ControlCommand.objects.get(turn=turn, action="start_turn")
    bridge.commands_to_deliver(connection_id=connection.pk)
    bridge.command_acked(connection_id=connection.pk, command_id=lost.pk)
    # the daemon is SIGKILLed with the turn in its local queue; a new run of it says hello
    bridge.connection_daemon_connected(connection_id=connection.pk, hello=HELLO)
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[], queued=[])
    commands = list(ControlCommand.objects.filter(turn=turn, action="start_turn").order_by("id"))
    assert [c.state for c in commands] == ["expired", "pending"]
    assert commands[1].payload == lost.payload
    assert Event.objects.filter(stream=turn.stream, kind="turn.redispatched", data__id=str(turn.pk)).exists()
    # acked on the current link: it is on its way, nothing is sent again
    bridge.commands_to_deliver(connection_id=connection.pk)
    bridge.command_acked(connection_id=connection.pk, command_id=commands[1].pk)
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[], queued=[])
    assert ControlCommand.objects.filter(turn=turn, action="start_turn").count() == 2


def test_a_start_the_daemon_still_queues_or_runs_is_not_sent_again(connection):
    queued = start(connection, prompt="@reply q", idea_key="idea:q")
    runs = start(connection, prompt="@reply r", idea_key="idea:r")
    bridge.commands_to_deliver(connection_id=connection.pk)
    for turn in (queued, runs):
        bridge.command_acked(connection_id=connection.pk,
                             command_id=ControlCommand.objects.get(turn=turn, action="start_turn").pk)
    bridge.connection_daemon_connected(connection_id=connection.pk, hello=HELLO)
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[held(runs)], queued=[str(queued.pk)])
    for turn in (queued, runs):
        assert ControlCommand.objects.filter(turn=turn, action="start_turn").count() == 1
