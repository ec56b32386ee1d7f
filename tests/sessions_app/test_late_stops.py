"""A stop marked ``unconfirmed`` (its deadline passed while the daemon was frozen, cut off or slow) is
the portal's doubt, not the daemon's truth (issue 7: "never confirmed while a process lives", "no
report dropped").  When the daemon comes back and carries out the stop, its steps still land: the
confirmation settles the turn, late and saying so; a step it reports on the way (``signalled``,
``escalated``) is accepted as superseded, never refused (a refusal parks the daemon's report and
holds the confirmation behind it).  And an operator may ask again for a stop that went unconfirmed."""

from __future__ import annotations

from datetime import timedelta

import pytest

from chorus_site.models import AuditEntry, Event
from sessions_app import actions, bridge
from sessions_app.models import ControlCommand, Turn
from tests import factories
from tests.sessions_app.test_reconcile_moved import online, report
from tests.sessions_app.test_reconcile_refused import away_and_swept, back_holding

pytestmark = pytest.mark.django_db


def running_turn(operator, connection, idea_key="idea:late") -> Turn:
    answer = actions.session_start(actor=operator, connection_id=connection.pk, cwd="/srv/a", prompt="@sleep 60",
                                   idea_key=idea_key)
    turn = Turn.objects.get(pk=answer["turn"])
    assert report(connection, turn, status="running", pid=4242).status_code == 200
    return turn


def past_deadline(turn) -> Turn:
    turn.refresh_from_db()
    assert actions.stops_settle_overdue(now=turn.stop_deadline_at + timedelta(seconds=1)) == 1
    turn.refresh_from_db()
    assert turn.stop_state == "unconfirmed"
    return turn


def late_events(turn) -> list[dict]:
    return [e.data for e in Event.objects.filter(stream=turn.stream, kind="turn.stop_late").order_by("id")]


def interrupt_commands(turn) -> list[ControlCommand]:
    return list(ControlCommand.objects.filter(turn=turn, action="interrupt").order_by("created_at"))


def test_a_daemons_stop_after_its_deadline_lands_late_with_every_step(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    turn = running_turn(operator, a)
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    past_deadline(turn)                        # the daemon was frozen: the stop is in doubt

    # It comes back and stops the agent; its reports go in order: signalled, escalated, interrupted.
    for step in ("signalled", "escalated"):
        answer = report(a, turn, status=None, stop_state=step)
        assert answer.status_code == 200, answer.content
        assert answer.json()["stop_state"] == "unconfirmed"   # superseded: still in doubt until confirmed
    answer = report(a, turn, status="interrupted", reason="user", stop_state="confirmed")
    assert answer.status_code == 200, answer.content

    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "user", "confirmed")
    assert [(e["step"], e["applied"]) for e in late_events(turn)] == [
        ("signalled", False), ("escalated", False), ("confirmed", True)]
    [audit] = AuditEntry.objects.filter(action="turn.stop_late", target=f"turn:{turn.pk}")
    assert "confirmed" in audit.outcome and audit.client == "daemon"


def test_a_late_exit_without_survivors_confirms_an_unconfirmed_stop(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    turn = running_turn(operator, a)
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    past_deadline(turn)
    assert report(a, turn, status="ended", final_reply="done anyway").status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.stop_state) == ("ended", "confirmed")
    assert [e["step"] for e in late_events(turn)] == ["confirmed"]


def test_a_late_exit_with_survivors_stays_unconfirmed(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    turn = running_turn(operator, a)
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    past_deadline(turn)
    assert report(a, turn, status="interrupted", reason="user",
                  background_processes=[{"pid": 99999, "cmdline": "sleep 600"}]).status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.stop_state) == ("interrupted", "unconfirmed")  # never pretended
    assert not AuditEntry.objects.filter(action="turn.stop_late").exists()


def test_an_operator_asks_again_for_a_stop_that_went_unconfirmed(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    turn = running_turn(operator, a)
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    first_deadline = past_deadline(turn).stop_deadline_at

    answer = actions.turn_interrupt(actor=operator, turn_id=turn.pk, reason="still running on the host")
    assert answer["changed"] is True and answer["dispatched"] is True and answer["stop_state"] == "requested"
    turn.refresh_from_db()
    assert turn.stop_state == "requested" and turn.stop_deadline_at > first_deadline
    assert [c.connection_id for c in interrupt_commands(turn)] == [a.pk, a.pk]
    assert AuditEntry.objects.filter(action="turn.interrupt", target=f"turn:{turn.pk}",
                                     outcome__contains="again").count() == 1
    # The first request's deadline does not judge the second.
    assert actions.turn_stop_deadline_check(turn_id=turn.pk, deadline=first_deadline.isoformat()) is False
    assert report(a, turn, status=None, stop_state="signalled").json()["stop_state"] == "signalled"
    assert report(a, turn, status="interrupted", reason="user", stop_state="confirmed").status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.stop_state) == ("interrupted", "confirmed")
    assert not late_events(turn)               # confirmed within the new deadline: not late


def test_a_held_stop_that_went_unconfirmed_is_asked_again_while_its_daemon_lists_the_process(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    b = online(factories.make_connection(cwds=["/srv/b"]))
    turn = running_turn(operator, a, idea_key="idea:held-late")
    actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b", prompt="next", idea_key="idea:held-late")
    away_and_swept(a)
    online(b)
    actions.session_message(actor=operator, session_id=turn.session_id, prompt="more")
    back_holding(a, turn)                      # not reopened (the session went on): A is told to stop it
    past_deadline(turn)

    answer = actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    assert answer["changed"] is True and answer["dispatched"] is True, answer
    assert [c.connection_id for c in interrupt_commands(turn)] == [a.pk, a.pk]
    assert Turn.objects.get(pk=turn.pk).stop_state == "requested"
    # The daemon's late steps of the first ask land too; its confirmation settles the stop.
    assert report(a, turn, status=None, stop_state="signalled").status_code == 200
    assert report(a, turn, status="interrupted", reason="user", stop_state="confirmed").status_code == 200
    assert Turn.objects.get(pk=turn.pk).stop_state == "confirmed"


def test_a_held_stop_that_went_unconfirmed_is_not_asked_again_once_its_daemon_no_longer_lists_it(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    b = online(factories.make_connection(cwds=["/srv/b"]))
    turn = running_turn(operator, a, idea_key="idea:held-gone")
    actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b", prompt="next", idea_key="idea:held-gone")
    away_and_swept(a)
    online(b)
    actions.session_message(actor=operator, session_id=turn.session_id, prompt="more")
    back_holding(a, turn)
    past_deadline(turn)
    bridge.connection_store_snapshot(connection_id=a.pk, queued=[], running=[])

    answer = actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    assert answer["changed"] is False, answer
    assert len(interrupt_commands(turn)) == 1
    # Nor automatically: a heartbeat listing it again does not re-ask on its own.
    bridge.connection_heartbeat(connection_id=a.pk, running=[str(turn.pk)])
    assert len(interrupt_commands(turn)) == 1


def test_a_late_not_held_answer_of_the_daemon_running_it_confirms_a_held_stop(operator):
    a = online(factories.make_connection(cwds=["/srv/a"]))
    b = online(factories.make_connection(cwds=["/srv/b"]))
    turn = running_turn(operator, a, idea_key="idea:held-answer")
    actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b", prompt="next",
                          idea_key="idea:held-answer")
    away_and_swept(a)
    online(b)
    actions.session_message(actor=operator, session_id=turn.session_id, prompt="more")
    back_holding(a, turn)
    past_deadline(turn)
    [stop] = interrupt_commands(turn)
    bridge.command_result(connection_id=b.pk, command_id=stop.pk, result={"held": False})  # not its daemon
    assert Turn.objects.get(pk=turn.pk).stop_state == "unconfirmed"
    bridge.command_result(connection_id=a.pk, command_id=stop.pk, result={"held": False})
    assert Turn.objects.get(pk=turn.pk).stop_state == "confirmed"
    assert [e["step"] for e in late_events(turn)] == ["confirmed"]
