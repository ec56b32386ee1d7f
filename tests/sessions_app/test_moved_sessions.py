"""A turn's commands and reports stay with the connection that runs it, even after its session moved
(issue 7 item 9), and a turn settled offline resumes like a crash (item 11, SPEC §4.3)."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from chorus_site.errors import ApplicationError
from sessions_app import actions, bridge
from sessions_app.models import Connection, ControlCommand, Session, Turn
from tests import factories
from tests.sessions_app.test_bridge_and_actions import online, report as bridge_report

pytestmark = pytest.mark.django_db

IDEA = "idea:moving"


def report(connection, turn, **body):
    return bridge_report(Client(), connection, turn, **body)


@pytest.fixture
def hosts():
    a = online(factories.make_connection(name=factories.unique("host-a"), cwds=["/srv/a"]))
    b = online(factories.make_connection(name=factories.unique("host-b"), cwds=["/srv/b"]))
    return a, b


def running_then_moved(operator, a, b):
    """A turn running on A; then the same idea is started on B: the session moves, the new turn waits."""
    first = actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a/app", prompt="@sleep 60",
                                  idea_key=IDEA)
    turn = Turn.objects.get(pk=first["turn"])
    assert report(a, turn, status="running", pid=4242, backend_session_id="cli-session-on-a").status_code == 200
    assert Session.objects.get(pk=turn.session_id).backend_session_id == "cli-session-on-a"
    moved = actions.session_start(actor=operator, connection_id=b.pk, cwd="/srv/b/app", prompt="next", idea_key=IDEA)
    assert moved["session"] == first["session"]
    session = Session.objects.get(pk=first["session"])
    assert (session.connection_id, session.cwd) == (b.pk, "/srv/b/app")
    return Turn.objects.get(pk=turn.pk), Turn.objects.get(pk=moved["turn"])


def test_the_running_turn_keeps_its_connection_and_the_move_queues_behind_it(operator, hosts):
    a, b = hosts
    turn, queued = running_then_moved(operator, a, b)
    assert turn.connection_id == a.pk
    assert queued.status == "pending" and not ControlCommand.objects.filter(turn=queued).exists()
    assert report(a, turn, status="ended", final_reply="done on A", backend_session_id="cli-session-on-a"
                  ).status_code == 200
    queued.refresh_from_db()
    start = ControlCommand.objects.get(turn=queued)
    assert (start.connection_id, start.payload["cwd"], queued.connection_id) == (b.pk, "/srv/b/app", b.pk)
    # A's agent session exists only on A: the moved session starts a fresh one on B.
    assert start.payload["backend_session_id"] is None
    assert Session.objects.get(pk=turn.session_id).backend_session_id is None


def test_interrupt_of_a_moved_sessions_turn_goes_to_the_connection_that_runs_it(operator, hosts):
    a, b = hosts
    turn, _ = running_then_moved(operator, a, b)
    answer = actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    assert answer["dispatched"] is True
    command = ControlCommand.objects.get(turn=turn, action="interrupt")
    assert command.connection_id == a.pk
    assert command.payload == {"sigint_timeout_s": a.sigint_timeout_s}


def test_the_new_connections_daemon_cannot_report_on_the_turn_it_does_not_run(operator, hosts):
    a, b = hosts
    turn, _ = running_then_moved(operator, a, b)
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    refused = report(b, turn, status="interrupted", reason="user", stop_state="confirmed")
    assert refused.status_code == 404
    events = Client().post(f"/api/v1/daemon/turns/{turn.pk}/events", content_type="application/json",
                           data=json.dumps({"report_id": str(uuid.uuid4()), "events": [{"kind": "text",
                                                                                         "data": {"text": "x"}}]}),
                           HTTP_AUTHORIZATION=f"Bearer {b.plain_key}")
    assert events.status_code == 404
    turn.refresh_from_db()
    assert (turn.status, turn.stop_state) == ("running", "requested")  # never "confirmed" while A's agent lives
    assert report(a, turn, status="interrupted", reason="user", stop_state="confirmed").status_code == 200
    turn.refresh_from_db()
    assert (turn.status, turn.stop_state) == ("interrupted", "confirmed")


def test_not_held_settles_only_when_the_runner_says_it(operator, hosts):
    a, b = hosts
    turn, _ = running_then_moved(operator, a, b)
    # An interrupt that reached B (as before the fix): B does not hold the turn, which proves nothing.
    stray = bridge.command_send(connection_id=b.pk, action="interrupt", turn_id=turn.pk)
    bridge.command_result(connection_id=b.pk, command_id=stray.pk, result={"held": False})
    turn.refresh_from_db()
    assert turn.status == "running"
    # The runner (A) does not hold it either (its agent is gone): that settles it, with the evidence.
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    command = ControlCommand.objects.get(turn=turn, action="interrupt", connection=a)
    bridge.command_result(connection_id=a.pk, command_id=command.pk, result={"held": False})
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason, turn.stop_state) == ("interrupted", "user", "confirmed")
    assert turn.interrupt_evidence["basis"] == "interrupt_not_held"
    assert turn.interrupt_evidence["connection"] == str(a.pk)


@pytest.mark.django_db(transaction=True)
def test_mark_interrupted_evidence_is_about_the_runner_not_the_new_connection(operator, hosts):
    a, b = hosts
    turn, _ = running_then_moved(operator, a, b)
    Connection.objects.filter(pk=a.pk).update(status="offline")  # B stays online
    evidence = actions.turn_gather_evidence(turn_id=turn.pk, probe_wait_s=0.2)
    assert evidence["basis"] == "connection_offline"
    assert not ControlCommand.objects.filter(turn=turn, action="probe").exists()


@pytest.mark.django_db(transaction=True)
def test_the_probe_goes_to_the_runner(operator, hosts):
    a, b = hosts
    turn, _ = running_then_moved(operator, a, b)
    bridge.connection_store_snapshot(connection_id=a.pk, running=[{"turn": str(turn.pk)}])
    with pytest.raises(ApplicationError) as refused:
        actions.turn_gather_evidence(turn_id=turn.pk, probe_wait_s=0.2)
    assert refused.value.code == "process_alive"
    assert ControlCommand.objects.get(turn=turn, action="probe").connection_id == a.pk


def test_the_sweep_judges_a_turn_by_the_connection_that_runs_it(operator, hosts):
    a, b = hosts
    turn, _ = running_then_moved(operator, a, b)
    stale = timezone.now() - timedelta(minutes=5)
    Connection.objects.filter(pk=b.pk).update(last_heartbeat_at=stale)  # the session's new host is gone
    bridge.connections_sweep_stale()
    turn.refresh_from_db()
    assert turn.status == "running"  # its own host (A) is alive
    Connection.objects.filter(pk=a.pk).update(last_heartbeat_at=stale)
    bridge.connections_sweep_stale()
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "offline")


# ---------------------------------------------------------------- item 11: resume after an offline settle
def test_a_turn_settled_offline_resumes_like_a_crash(operator, hosts):
    a, _ = hosts
    turn = Turn.objects.get(pk=actions.session_start(actor=operator, connection_id=a.pk, cwd="/srv/a/app",
                                                     prompt="@sleep 60", idea_key="idea:offline")["turn"])
    report(a, turn, status="running")
    Connection.objects.filter(pk=a.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    bridge.connections_sweep_stale()
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "offline")
    online(a)
    session = Session.objects.get(pk=turn.session_id)
    from sessions_app import selectors

    preflight = selectors.resume_preflight(session)
    assert preflight["resumable"] is True and preflight["refusal"] is None
    client = Client()
    client.force_login(operator)
    response = client.post(f"/api/v1/sessions/{session.pk}/resume", data=json.dumps({"context": "carry on"}),
                           content_type="application/json")
    assert response.status_code == 200, response.content
    resumed = Turn.objects.get(pk=response.json()["turn"])
    assert resumed.trigger == "resume" and resumed.prompt.startswith(actions.CRASH_PREFACE)
    assert "carry on" in resumed.prompt
    assert ControlCommand.objects.get(turn=resumed).action == "resume"
