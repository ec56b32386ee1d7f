"""A turn settled offline that may not run again, while its daemon still holds its process (issue 7
item 10: "interrupt must always reach a process that a daemon says it holds"): the portal tells that
daemon to stop it, explicitly and audited, and the stop is confirmed only by that daemon.

Refused reopens: the session went on with a later turn (moved elsewhere), or the engine has already
ended the turn's attempt (a new attempt would do the same work twice)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from chorus_site.models import AuditEntry, Event
from executions import engine
from executions.models import Attempt
from sessions_app import actions, bridge
from sessions_app.models import Connection, ControlCommand, Turn
from tests import factories
from tests.sessions_app.test_reconcile_moved import HELLO, online, report

pytestmark = pytest.mark.django_db


def held(turn, pid=4242) -> dict:
    return {"turn": str(turn.pk), "session": str(turn.session_id), "pid": pid, "pgid": pid, "started_at": 1.0,
            "process_start_time": 1.0}


def away_and_swept(connection):
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    bridge.connection_daemon_disconnected(connection_id=connection.pk)
    bridge.connections_sweep_stale()


def back_holding(connection, turn):
    bridge.connection_daemon_connected(connection_id=connection.pk, hello={**HELLO, "cwds": connection.cwds})
    bridge.connection_store_snapshot(connection_id=connection.pk, queued=[], running=[held(turn)])


def stops_sent(turn) -> list[ControlCommand]:
    return list(ControlCommand.objects.filter(turn=turn, action="interrupt"))


def assert_told_to_stop(turn, connection, refusal: str):
    """Settled it stays; its daemon, and only its daemon, is asked once to stop; not confirmed yet."""
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "offline", "requested")
    assert turn.stop_deadline_at is not None
    [stop] = stops_sent(turn)
    assert stop.connection_id == connection.pk
    [event] = Event.objects.filter(stream=turn.stream, kind="turn.held_stop", data__id=str(turn.pk))
    assert refusal in event.data["not_reopened"] and event.data["evidence"]["basis"] == "snapshot"
    [audit] = AuditEntry.objects.filter(action="turn.reconcile", target=f"turn:{turn.pk}")
    assert "told to stop" in audit.outcome and refusal in audit.reason


def test_a_held_turn_not_reopened_over_its_moved_session_is_stopped_on_its_daemon(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    b = online(factories.make_connection(cwds=["/srv/b"]))
    turn = Turn.objects.get(pk=actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a",
                                                     prompt="@sleep 60", idea_key="idea:held")["turn"])
    assert report(a, turn, status="running", pid=4242).status_code == 200
    actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b", prompt="next", idea_key="idea:held")
    away_and_swept(a)
    online(b)
    actions.session_message(actor=operator, session_id=turn.session_id, prompt="more")  # sent to B
    back_holding(a, turn)                      # A still runs the old agent: reopen refused (conflict)

    assert_told_to_stop(turn, a, "another turn of this session runs")
    # Each heartbeat and report that lists it again asks nothing more; a 'running' report is the
    # daemon's word that the process lives, answered with the stop under way (not refused and parked).
    bridge.connection_heartbeat(connection_id=a.pk, running=[str(turn.pk)])
    answer = report(a, turn, status="running", pid=4242)
    assert answer.status_code == 200 and answer.json()["stop_state"] == "requested", answer.json()
    assert len(stops_sent(turn)) == 1
    # The daemon stops the agent and says so: only now is the stop confirmed.
    assert report(a, turn, status=None, stop_state="signalled").status_code == 200
    assert report(a, turn, status="interrupted", reason="user", stop_state="confirmed").status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "offline", "confirmed")


def test_a_held_stop_the_daemon_never_confirms_becomes_unconfirmed(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    b = online(factories.make_connection(cwds=["/srv/b"]))
    turn = Turn.objects.get(pk=actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a",
                                                     prompt="@sleep 60", idea_key="idea:silent")["turn"])
    assert report(a, turn, status="running", pid=4242).status_code == 200
    actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b", prompt="next", idea_key="idea:silent")
    away_and_swept(a)
    online(b)
    actions.session_message(actor=operator, session_id=turn.session_id, prompt="more")
    back_holding(a, turn)
    turn.refresh_from_db()
    assert actions.stops_settle_overdue(now=turn.stop_deadline_at + timedelta(seconds=1)) == 1
    assert Turn.objects.get(pk=turn.pk).stop_state == "unconfirmed"


def test_a_held_turn_whose_attempt_the_engine_ended_is_not_reopened_and_is_stopped():
    """Item 3: the sweep settled the attempt's turn offline, the engine failed the attempt (infra) and
    will retry it; the old agent running on would do the work twice."""
    connection = online(factories.make_connection(cwds=["/srv/a"], max_concurrency=10))
    run = engine.run_start(issue_id=factories.make_issue().pk, mode="direct", input={"prompt": "@sleep 60"},
                           target={"connection": str(connection.pk)})
    engine.run_tick_apply(run_id=run.pk)
    attempt = Attempt.objects.get(task__node__run=run)
    turn = Turn.objects.get(pk=attempt.turn_id)
    bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "running", "pid": 4242})
    away_and_swept(connection)
    engine.run_tick_apply(run_id=run.pk)       # the engine acts on the settle: attempt 1 failed, a retry follows
    assert Attempt.objects.get(pk=attempt.pk).state == "failed"

    back_holding(connection, turn)

    assert_told_to_stop(turn, connection, "attempt 1 of its task already ended failed")
    assert not Event.objects.filter(stream=turn.stream, kind="turn.reconciled").exists()


def test_a_held_stop_answered_not_held_by_its_daemon_is_confirmed(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    b = online(factories.make_connection(cwds=["/srv/b"]))
    turn = Turn.objects.get(pk=actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a",
                                                     prompt="@sleep 60", idea_key="idea:gone")["turn"])
    assert report(a, turn, status="running", pid=4242).status_code == 200
    actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b", prompt="next", idea_key="idea:gone")
    away_and_swept(a)
    online(b)
    actions.session_message(actor=operator, session_id=turn.session_id, prompt="more")
    back_holding(a, turn)
    [stop] = stops_sent(turn)
    bridge.command_result(connection_id=b.pk, command_id=stop.pk, result={"held": False})  # not its daemon
    assert Turn.objects.get(pk=turn.pk).stop_state == "requested"
    bridge.command_result(connection_id=a.pk, command_id=stop.pk, result={"held": False})  # the agent exited
    assert Turn.objects.get(pk=turn.pk).stop_state == "confirmed"


def test_a_held_turn_an_operator_marked_interrupted_while_its_daemon_was_away_is_stopped(operator):
    """Marked interrupted on the evidence of a stale heartbeat (a frozen daemon), the process lived on:
    its daemon's word is heard, and the operator's settle is carried out on the process."""
    a = online(factories.make_connection(cwds=["/srv/a"]))
    turn = Turn.objects.get(pk=actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a",
                                                     prompt="@sleep 60")["turn"])
    assert report(a, turn, status="running", pid=4242).status_code == 200
    Connection.objects.filter(pk=a.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    evidence = actions._evidence_without_probe(Turn.objects.get(pk=turn.pk), Connection.objects.get(pk=a.pk))
    assert evidence["basis"] == "heartbeat_stale"
    actions.turn_mark_interrupted(actor=operator, turn_id=turn.pk, evidence=evidence)
    bridge.connection_heartbeat(connection_id=a.pk, running=[str(turn.pk)])   # SIGCONT: it still holds it

    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "user", "requested")
    [stop] = stops_sent(turn)
    assert stop.connection_id == a.pk
    assert report(a, turn, status="interrupted", reason="user", stop_state="confirmed").status_code == 200
    assert Turn.objects.get(pk=turn.pk).stop_state == "confirmed"


def test_an_interrupt_of_a_settled_turn_its_daemon_lists_reaches_the_process(operator):
    """Item 10: 'interrupt answers changed: false — nothing in the portal can stop it'.  Marked
    interrupted while its daemon is frozen (its latest snapshot lists the turn): the operator's
    interrupt sends the stop to that daemon and says so."""
    a = online(factories.make_connection(cwds=["/srv/a"]))
    turn = Turn.objects.get(pk=actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a",
                                                     prompt="@sleep 60")["turn"])
    assert report(a, turn, status="running", pid=4242).status_code == 200
    bridge.connection_store_snapshot(connection_id=a.pk, queued=[], running=[held(turn)])
    Connection.objects.filter(pk=a.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))  # frozen
    evidence = actions._evidence_without_probe(Turn.objects.get(pk=turn.pk), Connection.objects.get(pk=a.pk))
    actions.turn_mark_interrupted(actor=operator, turn_id=turn.pk, evidence=evidence)

    answer = actions.turn_interrupt(actor=operator, turn_id=turn.pk)

    assert (answer["changed"], answer["dispatched"], answer["stop_state"]) == (True, True, "requested"), answer
    [stop] = stops_sent(turn)
    assert stop.connection_id == a.pk
    assert AuditEntry.objects.filter(action="turn.interrupt", target=f"turn:{turn.pk}",
                                     outcome__startswith="stop requested").exists()
    assert actions.turn_interrupt(actor=operator, turn_id=turn.pk)["changed"] is False  # asked once
