"""Operator actions racing the daemon's reports, for real on PostgreSQL (issue 7 item 4).

The lock order is connection → session → turn everywhere (chorus_site/transitions.py); an action
that took the turn first and the session second deadlocked against the daemon's ``ended`` report.
A deadlock shows up as an ``OperationalError``/``DeadlockDetected`` in ``run_together``'s outcomes.
"""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from chorus_site.models import Event
from sessions_app import actions, bridge, states
from sessions_app.models import Connection, Turn
from tests import factories
from tests.concurrency import run_together

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 20
QUESTION = {"kind": "confirmation", "items": [{"id": "q1", "text": "Proceed?"}]}


def live_connection() -> Connection:
    connection = factories.make_connection()
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    connection.refresh_from_db()
    return connection


def ended_report(connection, turn, answers: list):
    """The daemon's end report; its HTTP status is kept (200 applied, 409 refused as stale)."""

    def call():
        status, body, _ = bridge.report_advance(connection=connection, turn_id=turn.pk, report={
            "report_id": str(uuid.uuid4()), "status": "ended", "final_reply": "all done", "usage": {"output": 3}})
        answers.append((status, body))
        assert status in {200, 409}, (status, body)

    return call


def turn_endings(turn) -> list[str]:
    return [e.data["status"] for e in Event.objects.filter(stream=turn.stream, kind="turn.status",
                                                           data__id=str(turn.pk)).order_by("id")]


def test_an_answer_and_the_ended_report_do_not_deadlock(operator):
    connection = live_connection()
    for _ in range(ROUNDS):
        session = factories.make_session(connection=connection)
        turn = factories.make_turn(session=session, status=states.REQUIRES_ACTION, requires_action=QUESTION,
                                   started_at=timezone.now())
        reports = []
        outcomes = run_together(
            lambda: actions.turn_answer(actor=operator, turn_id=turn.pk, answers=[{"id": "q1", "answer": "yes"}]),
            ended_report(connection, turn, reports),
        )
        answered, reported = outcomes
        assert reported == "ok" and answered in {"ok", "invalid_transition"}, outcomes
        # Exactly one of them ended the turn; a resume turn carries the answer if and only if it won.
        assert Turn.objects.get(pk=turn.pk).status == states.ENDED
        assert turn_endings(turn) == [states.ENDED]
        resumes = Turn.objects.filter(session=session, trigger="resume")
        [(status, _body)] = reports
        if answered == "ok":
            assert status == 409 and resumes.count() == 1 and "yes" in resumes.get().prompt
        else:
            assert status == 200 and resumes.count() == 0


def test_an_interrupt_and_the_ended_report_do_not_deadlock(operator):
    connection = live_connection()
    for _ in range(ROUNDS):
        session = factories.make_session(connection=connection)
        turn = factories.make_turn(session=session, status=states.RUNNING, started_at=timezone.now())
        reports = []
        outcomes = run_together(
            lambda: actions.turn_interrupt(actor=operator, turn_id=turn.pk, reason="stop"),
            ended_report(connection, turn, reports),
        )
        interrupted, reported = outcomes
        assert reported == "ok" and interrupted in {"ok", "invalid_transition"}, outcomes
        stored = Turn.objects.get(pk=turn.pk)
        [(status, _body)] = reports
        assert status == 200 and stored.status == states.ENDED
        assert turn_endings(turn) == [states.ENDED]
        # A stop asked of a turn whose agent then exited leaving nothing behind is confirmed, never left
        # "requested" for the deadline to call unconfirmed; a turn that had ended has no stop at all.
        assert stored.stop_state == (states.STOP_CONFIRMED if interrupted == "ok" else states.STOP_NONE), outcomes
