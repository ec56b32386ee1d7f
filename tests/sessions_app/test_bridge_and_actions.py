"""Portal side of the bridge and the operator actions, driven through the API (SPEC §4, §5, §8)."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from chorus_site.models import AuditEntry
from sessions_app import actions, bridge
from sessions_app.models import Connection, ControlCommand, Session, Turn
from tests import factories

pytestmark = pytest.mark.django_db

CANARY = "sk-proj-BRIDGEcanary0123456789abcdefXYZ"


def online(connection: Connection) -> Connection:
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    connection.refresh_from_db()
    return connection


def api(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post(client, url, body=None, **headers):
    return client.post(url, data=json.dumps(body or {}), content_type="application/json", headers=headers)


def daemon(connection) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {connection.plain_key}"}


def report(client, connection, turn, **body):
    body.setdefault("report_id", str(uuid.uuid4()))
    return client.post(f"/api/v1/daemon/turns/{turn.pk}/advance", data=json.dumps(body),
                       content_type="application/json", **daemon(connection))


@pytest.fixture
def connection():
    return online(factories.make_connection(cwds=["/srv/work"]))


def start(operator, connection, prompt="@reply hi", **extra):
    response = post(api(operator), "/api/v1/sessions",
                    {"connection": str(connection.pk), "cwd": "/srv/work/app", "prompt": prompt, **extra})
    assert response.status_code == 201, response.content
    return response.json()


def test_start_creates_a_session_and_sends_the_command(operator, connection):
    answer = start(operator, connection)
    turn = Turn.objects.get(pk=answer["turn"])
    assert turn.status == "pending"
    command = ControlCommand.objects.get(turn=turn)
    assert command.action == "start_turn" and command.connection_id == connection.pk
    assert command.payload["cwd"] == "/srv/work/app" and command.payload["prompt"] == "@reply hi"
    assert AuditEntry.objects.filter(action="session.start", actor=operator.username).count() == 1


def test_start_refuses_offline_connection_and_foreign_cwd(operator):
    offline = factories.make_connection(cwds=["/srv/work"])
    response = post(api(operator), "/api/v1/sessions", {"connection": str(offline.pk), "cwd": "/srv/work",
                                                        "prompt": "x"})
    assert response.status_code == 409 and response.json()["error"]["code"] == "connection_offline"
    live = online(factories.make_connection(cwds=["/srv/work"]))
    response = post(api(operator), "/api/v1/sessions", {"connection": str(live.pk), "cwd": "/etc", "prompt": "x"})
    assert response.status_code == 400
    assert Session.objects.filter(connection__in=[offline, live]).count() == 0


def test_viewer_may_not_act(viewer, connection):
    response = post(api(viewer), "/api/v1/sessions", {"connection": str(connection.pk), "cwd": "/srv/work",
                                                      "prompt": "x"})
    assert response.status_code == 403


def test_idempotency_key_replays_the_start(operator, connection):
    client = api(operator)
    body = {"connection": str(connection.pk), "cwd": "/srv/work", "prompt": "once"}
    first = post(client, "/api/v1/sessions", body, **{"Idempotency-Key": "k1"})
    again = post(client, "/api/v1/sessions", body, **{"Idempotency-Key": "k1"})
    assert first.json() == again.json()
    assert Turn.objects.filter(prompt="once").count() == 1
    other = post(client, "/api/v1/sessions", {**body, "prompt": "twice"}, **{"Idempotency-Key": "k1"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_mismatch"


def test_daemon_reports_a_turn_to_its_end_once(operator, connection):
    answer = start(operator, connection)
    turn = Turn.objects.get(pk=answer["turn"])
    client = Client()
    assert report(client, connection, turn, status="running", pid=4242).status_code == 200
    end = {"report_id": str(uuid.uuid4()), "status": "ended", "final_reply": "done", "backend_session_id": "bs-1",
           "usage": {"input": 10, "output": 5}, "changes": {"git": True, "status": [" M a.py"]}}
    assert report(client, connection, turn, **end).status_code == 200
    assert report(client, connection, turn, **end).status_code == 200  # the same report id again: no effect
    turn.refresh_from_db()
    session = turn.session
    session.refresh_from_db()
    assert turn.status == "ended" and turn.final_reply == "done" and turn.changes["status"] == [" M a.py"]
    assert session.backend_session_id == "bs-1" and session.tokens_input == 10
    assert [(m.role, m.text) for m in session.transcript.all()] == [("user", "@reply hi"), ("assistant", "done")]


def test_daemon_cannot_report_on_another_connections_turn_nor_offline(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    stranger = online(factories.make_connection())
    assert report(Client(), stranger, turn, status="running").status_code == 404
    report(Client(), connection, turn, status="running")
    refused = report(Client(), connection, turn, status="interrupted", reason="offline")
    assert refused.status_code == 422  # not a reason a daemon may report: refused by the report's schema
    assert report(Client(), connection, turn, status="running", report_id="x").status_code in (200, 409)
    bad_key = Client().post(f"/api/v1/daemon/turns/{turn.pk}/advance", data="{}", content_type="application/json",
                            HTTP_AUTHORIZATION="Bearer chk_nope_nope")
    assert bad_key.status_code == 401


def test_agent_events_are_stored_redacted(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    body = {"report_id": str(uuid.uuid4()), "events": [
        {"kind": "text", "data": {"text": f"export OPENAI_API_KEY={CANARY}"}},
        {"kind": "session", "data": {"id": "agent-session-9"}},
        {"kind": "not-a-kind", "data": {}}]}
    response = Client().post(f"/api/v1/daemon/turns/{turn.pk}/events", data=json.dumps(body),
                             content_type="application/json", **daemon(connection))
    assert response.json() == {"accepted": 2, "skipped": 1}
    stored = factories.events_of(turn.stream, kind="turn.output")
    assert CANARY not in json.dumps([e.data for e in stored])
    assert Session.objects.get(pk=turn.session_id).backend_session_id == "agent-session-9"


def test_interrupt_pending_settles_at_once_and_running_requests_a_stop(operator, connection):
    client = api(operator)
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    answer = post(client, f"/api/v1/turns/{turn.pk}/interrupt").json()
    assert answer["settled"] is True and answer["dispatched"] is False
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    assert ControlCommand.objects.get(turn=turn, action="start_turn").state == "expired"
    again = post(client, f"/api/v1/turns/{turn.pk}/interrupt").json()
    assert again["changed"] is False

    second = Turn.objects.get(pk=post(client, f"/api/v1/sessions/{turn.session_id}/messages",
                                      {"prompt": "@sleep 60"}).json()["turn"])
    report(Client(), connection, second, status="running", pid=1)
    answer = post(client, f"/api/v1/turns/{second.pk}/interrupt", {"reason": "wrong branch"}).json()
    assert answer["dispatched"] is True and answer["settled"] is False
    second.refresh_from_db()
    assert second.stop_state == "requested" and second.status == "running"
    command = ControlCommand.objects.get(turn=second, action="interrupt")
    assert command.payload == {"sigint_timeout_s": connection.sigint_timeout_s}
    # No confirmation came: the deadline job says so, it never pretends.
    assert actions.turn_stop_deadline_check(turn_id=second.pk) is True
    second.refresh_from_db()
    assert second.stop_state == "unconfirmed" and second.status == "running"
    # The daemon's confirmation still lands afterwards.
    report(Client(), connection, second, status="interrupted", reason="user", stop_state="confirmed")
    second.refresh_from_db()
    assert (second.status, second.stop_state) == ("interrupted", "confirmed")


def test_interrupting_an_ended_turn_is_invalid(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    report(Client(), connection, turn, status="ended")
    response = post(api(operator), f"/api/v1/turns/{turn.pk}/interrupt")
    assert response.status_code == 409 and response.json()["error"]["code"] == "invalid_transition"


def test_busy_session_queues_and_merges_later_messages(operator, connection):
    client = api(operator)
    first = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, first, status="running")
    a = post(client, f"/api/v1/sessions/{first.session_id}/messages", {"prompt": "second"}).json()
    b = post(client, f"/api/v1/sessions/{first.session_id}/messages", {"prompt": "third"}).json()
    assert a["queued"] and b["queued"]
    assert not ControlCommand.objects.filter(turn_id__in=[a["turn"], b["turn"]]).exists()
    report(Client(), connection, first, status="ended")  # the next pending turn is dispatched, merged
    second, third = Turn.objects.get(pk=a["turn"]), Turn.objects.get(pk=b["turn"])
    assert third.status == "merged" and third.merged_into_id == second.pk
    assert "second" in second.prompt and "third" in second.prompt
    assert ControlCommand.objects.get(turn=second).payload["prompt"] == second.prompt


@pytest.mark.django_db(transaction=True)
def test_mark_interrupted_with_offline_connection_records_evidence(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    Connection.objects.filter(pk=connection.pk).update(status="offline")
    answer = post(api(operator), f"/api/v1/turns/{turn.pk}/mark-interrupted", {"reason": "host rebooted"}).json()
    assert answer["changed"] is True and answer["evidence"]["basis"] == "connection_offline"
    turn.refresh_from_db()
    assert turn.interrupted_reason == "user" and turn.interrupt_evidence["basis"] == "connection_offline"


@pytest.mark.django_db(transaction=True)
def test_mark_interrupted_when_the_daemon_holds_it_is_process_alive(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    bridge.connection_store_snapshot(connection_id=connection.pk, running=[{"turn": str(turn.pk)}])
    with pytest.raises(Exception) as refused:
        actions.turn_gather_evidence(turn_id=turn.pk, probe_wait_s=0.2)
    assert getattr(refused.value, "code", None) == "process_alive"
    probe = ControlCommand.objects.get(turn=turn, action="probe")
    bridge.command_result(connection_id=connection.pk, command_id=probe.pk, result={"held": False})
    turn.refresh_from_db()
    assert turn.status == "running"


def test_resume_offline_is_409_and_changes_nothing(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    report(Client(), connection, turn, status="interrupted", reason="crash",
           wake_error={"kind": "exited_nonzero", "exit_code": 1, "details": "boom"})
    Connection.objects.filter(pk=connection.pk).update(status="offline")
    before = Turn.objects.count(), ControlCommand.objects.count()
    response = post(api(operator), f"/api/v1/sessions/{turn.session_id}/resume", {"context": "try again"})
    assert response.status_code == 409 and response.json()["error"]["code"] == "connection_offline"
    assert (Turn.objects.count(), ControlCommand.objects.count()) == before
    online(connection)
    answer = post(api(operator), f"/api/v1/sessions/{turn.session_id}/resume", {"context": "try again"}).json()
    resumed = Turn.objects.get(pk=answer["turn"])
    assert resumed.trigger == "resume" and "re-check" in resumed.prompt and "try again" in resumed.prompt
    assert ControlCommand.objects.get(turn=resumed).action == "resume"


def test_handoff_links_both_sessions(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    report(Client(), connection, turn, status="ended", final_reply="half done")
    answer = post(api(operator), f"/api/v1/sessions/{turn.session_id}/handoff", {"context": "finish it"}).json()
    new = Session.objects.get(pk=answer["session"])
    old = Session.objects.get(pk=turn.session_id)
    assert new.handoff_from_id == old.pk and old.status == "ended"
    first = new.turns.get()
    assert first.trigger == "handoff" and "half done" in first.prompt and "finish it" in first.prompt


def test_sweep_settles_turns_of_stale_connections(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    result = bridge.connections_sweep_stale()
    assert result["turns_settled"] >= 1
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "offline")
    assert Connection.objects.get(pk=connection.pk).status == "offline"


def test_acknowledge_changes_guard(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection, idea_key="idea:a")["turn"])
    report(Client(), connection, turn, status="running")
    report(Client(), connection, turn, status="interrupted", reason="user", changes={"status": [" M x"]})
    client = api(operator)
    body = {"connection": str(connection.pk), "cwd": "/srv/work/app", "prompt": "other", "idea_key": "idea:b"}
    refused = post(client, "/api/v1/sessions", body)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "changes_unacknowledged"
    assert post(client, "/api/v1/sessions", {**body, "acknowledge_changes": True}).status_code == 201


def test_same_idea_from_another_directory_moves_the_session(operator, connection):
    first = start(operator, connection, idea_key="idea:move")
    Turn.objects.filter(pk=first["turn"]).update(status="ended")
    response = post(api(operator), "/api/v1/sessions", {"connection": str(connection.pk), "cwd": "/srv/work/other",
                                                       "prompt": "go on", "idea_key": "idea:move"})
    assert response.json()["session"] == first["session"]
    session = Session.objects.get(pk=first["session"])
    assert session.cwd == "/srv/work/other"
    assert factories.events_of(session.stream, kind="session.moved")


def test_crashed_turns_resume_once_on_reconnect_when_configured(operator, connection):
    Connection.objects.filter(pk=connection.pk).update(auto_resume_crashed=True)
    crashed = Turn.objects.get(pk=start(operator, connection, idea_key="idea:crash")["turn"])
    report(Client(), connection, crashed, status="running")
    report(Client(), connection, crashed, status="interrupted", reason="crash",
           wake_error={"kind": "signal", "signal": "SIGKILL"})
    stopped = Turn.objects.get(pk=start(operator, connection, idea_key="idea:user", acknowledge_changes=True)["turn"])
    report(Client(), connection, stopped, status="running")
    report(Client(), connection, stopped, status="interrupted", reason="user")
    Connection.objects.filter(pk=connection.pk).update(status="offline")
    bridge.connection_daemon_connected(connection_id=connection.pk, hello={"version": "t"})
    resumed = Turn.objects.filter(session=crashed.session, trigger="resume")
    assert resumed.count() == 1 and "re-check" in resumed.get().prompt
    assert not Turn.objects.filter(session=stopped.session, trigger="resume").exists()  # user stops never
    bridge.connection_daemon_connected(connection_id=connection.pk, hello={"version": "t"})
    assert Turn.objects.filter(session=crashed.session, trigger="resume").count() == 1  # once


def test_answering_a_requires_action_turn_then_resuming_dispatches(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    ask = {"kind": "confirmation", "items": [{"id": "q1", "text": "Deploy?"}]}
    report(Client(), connection, turn, status="requires_action", requires_action=ask)
    again = report(Client(), connection, turn, status="requires_action", requires_action=ask,
                   usage={"input": 3, "output": 1})
    assert again.status_code == 200  # a repeated wait adds data, it is not refused
    assert Turn.objects.get(pk=turn.pk).usage == {"input": 3, "output": 1}
    answered = post(api(operator), f"/api/v1/turns/{turn.pk}/actions", {"answers": [{"id": "q1", "answer": "yes"}]})
    resumed = answered.json()
    assert resumed["all_answered"] is True and resumed["queued"] is False  # the answers resume it at once
    assert "Deploy?: yes" in Turn.objects.get(pk=resumed["turn"]).prompt
    assert Turn.objects.get(pk=turn.pk).status == "ended"
    assert ControlCommand.objects.get(turn_id=resumed["turn"]).action == "resume"


def test_a_stop_with_survivors_is_not_confirmed(operator, connection):
    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    post(api(operator), f"/api/v1/turns/{turn.pk}/interrupt")
    report(Client(), connection, turn, status="interrupted", reason="user",
           background_processes=[{"pid": 99999, "cmdline": "sleep 600"}])
    turn.refresh_from_db()
    assert turn.status == "interrupted" and turn.stop_state == "requested"
    assert actions.turn_stop_deadline_check(turn_id=turn.pk) is True
    turn.refresh_from_db()
    assert turn.stop_state == "unconfirmed"  # in doubt, visibly


def test_only_ops_admin_drains_and_undrain_returns_to_the_live_status(operator, ops_admin_user, connection):
    url = f"/api/v1/connections/{connection.pk}"
    assert post(api(operator), url + "/drain").status_code == 403
    drained = post(api(ops_admin_user), url + "/drain").json()
    assert drained == {"changed": True, "status": "draining"}
    assert post(api(ops_admin_user), url + "/drain").json()["changed"] is False
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert post(api(ops_admin_user), url + "/undrain").json()["status"] == "offline"  # stale: not online
