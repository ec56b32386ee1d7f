"""The periodic sweep recovers from the database what a lost Celery message would have done (issue 7
items 1, 6 and the one staleness threshold): overdue stops, pending turns of gone connections."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from chorus_site.models import Event
from sessions_app import actions, bridge, selectors
from sessions_app.models import Connection, ControlCommand, Turn
from tests import factories

pytestmark = pytest.mark.django_db


def threshold_s() -> int:
    return getattr(settings, "CHORUS_HEARTBEAT_TIMEOUT_S", 20)  # (20 s was the sweep's before it was one setting)


def online(connection, *, age_s: float = 0):
    Connection.objects.filter(pk=connection.pk).update(
        status="online", last_heartbeat_at=timezone.now() - timedelta(seconds=age_s))
    connection.refresh_from_db()
    return connection


@pytest.fixture
def connection():
    return online(factories.make_connection(cwds=["/srv/work"], sigint_timeout_s=2))


def pending_turn(operator, connection) -> Turn:
    answer = actions.session_start(actor=operator, connection_id=connection.pk, cwd="/srv/work/app",
                                   prompt="@sleep 60")
    return Turn.objects.get(pk=answer["turn"])


def running_turn(operator, connection) -> Turn:
    turn = pending_turn(operator, connection)
    bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "running", "pid": 4242})
    return Turn.objects.get(pk=turn.pk)


def unconfirmed_events(turn) -> int:
    return Event.objects.filter(stream=f"session:{turn.session_id}", kind="turn.stop_state", data__id=str(turn.pk),
                                data__stop_state="unconfirmed").count()


def test_the_sweep_marks_a_stop_past_its_deadline_unconfirmed_once(operator, connection):
    turn = running_turn(operator, connection)
    answer = actions.turn_interrupt(actor=operator, turn_id=turn.pk)  # its deadline message is never delivered
    turn.refresh_from_db()
    assert turn.stop_state == "requested" and turn.stop_deadline_at is not None

    assert actions.stops_settle_overdue(now=turn.stop_deadline_at - timedelta(seconds=1)) == 0
    assert Turn.objects.get(pk=turn.pk).stop_state == "requested"  # not before its deadline

    later = turn.stop_deadline_at + timedelta(seconds=1)
    assert actions.stops_settle_overdue(now=later) == 1
    assert actions.stops_settle_overdue(now=later) == 0
    assert actions.turn_stop_deadline_check(turn_id=turn.pk) is False  # the deadline message, late: nothing left
    turn.refresh_from_db()
    assert (turn.status, turn.stop_state) == ("running", "unconfirmed")
    assert unconfirmed_events(turn) == 1
    assert answer["deadline"] == turn.stop_deadline_at.isoformat()


def test_the_sweep_settles_pending_turns_of_a_connection_gone_past_the_threshold(operator, connection):
    gone = pending_turn(operator, connection)
    acked = ControlCommand.objects.get(turn=gone, action="start_turn")
    bridge.command_acked(connection_id=connection.pk, command_id=acked.pk)  # then the daemon was SIGKILLed
    queued = Turn.objects.get(pk=actions.session_message(actor=operator, session_id=gone.session_id,
                                                         prompt="and then this")["turn"])
    unsent = pending_turn(operator, connection)  # another session: its command was never taken
    other = online(factories.make_connection(cwds=["/srv/work"]))
    alive = pending_turn(operator, other)
    grace = bridge.PENDING_GRACE_FACTOR * threshold_s()  # pending turns wait longer than running ones
    long_ago = timezone.now() - timedelta(seconds=grace + 60)
    Turn.objects.filter(pk__in=[gone.pk, queued.pk, unsent.pk, alive.pk]).update(created_at=long_ago)
    online(connection, age_s=grace + 30)

    result = bridge.connections_sweep_stale()

    assert result["pending_settled"] == 3
    for turn in (gone, queued, unsent):
        turn.refresh_from_db()
        assert (turn.status, turn.interrupted_reason) == ("interrupted", "offline")
        assert turn.interrupt_evidence["basis"] == "connection_gone_while_pending"
        assert turn.interrupt_evidence["last_heartbeat_at"]
    assert Turn.objects.get(pk=alive.pk).status == "pending"  # its connection is live
    # A command the daemon never took is withdrawn, so a daemon that comes back does not start it.
    assert ControlCommand.objects.get(turn=unsent, action="start_turn").state == "expired"
    assert ControlCommand.objects.get(turn=gone, action="start_turn").state == "acked"
    assert bridge.connections_sweep_stale()["pending_settled"] == 0


def test_a_just_queued_turn_is_not_settled_by_the_sweep(operator, connection):
    turn = pending_turn(operator, connection)
    online(connection, age_s=threshold_s() + 1)
    assert bridge.connections_sweep_stale()["pending_settled"] == 0
    assert Turn.objects.get(pk=turn.pk).status == "pending"


@pytest.mark.parametrize("offset_s", [-3, 3])
def test_one_staleness_threshold_for_liveness_and_the_sweep(connection, offset_s):
    """'Live' (new work, evidence) and 'stale' (the sweep) are the same question with the same answer."""
    online(connection, age_s=threshold_s() + offset_s)
    live = selectors.connection_is_live(connection)
    swept = bridge.connections_sweep_stale()["connections_offline"] == 1
    assert live is (offset_s < 0)
    assert swept is (offset_s > 0)
