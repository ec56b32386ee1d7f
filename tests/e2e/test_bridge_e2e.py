"""The bridge end to end (issue: conversation control): a real portal, a real daemon spawning the
scripted agent, a real Celery worker with beat.  Nothing is simulated."""

from __future__ import annotations

import json

import pytest

from chorus_site.models import Event
from chorus_site.tokens import token_create
from sessions_app.models import Connection, Session, Turn
from tests.e2e.conftest import Api, alive, kill_group, output_value, start_portal, stop_process, wait_online, wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

CANARY = "sk-ant-api03-E2Ecanary0000000000SECRET11111"
SIGINT_TIMEOUT_S = 2  # as the bridge fixture configures the connection


def start(bridge, prompt: str, **extra) -> Turn:
    status, body = bridge["api"].call("POST", "/sessions", {
        "connection": str(bridge["connection"].pk), "cwd": str(bridge["workspace"]), "prompt": prompt, **extra})
    assert status == 201, body
    return Turn.objects.get(pk=body["turn"])


def wait_status(turn, statuses, timeout=30):
    statuses = {statuses} if isinstance(statuses, str) else set(statuses)
    return wait_until(lambda: (t := Turn.objects.get(pk=turn.pk)).status in statuses and t, timeout=timeout,
                      message=f"turn to reach {statuses}")


def test_a_started_session_runs_a_turn_to_its_end(bridge):
    turn = start(bridge, "@write notes.txt hello\n@usage 12 34\n@reply All done\nPlease take notes.")
    turn = wait_status(turn, "ended")
    assert turn.final_reply == "All done"
    assert (bridge["workspace"] / "notes.txt").read_text().strip() == "hello"
    assert "notes.txt" in json.dumps(turn.changes)
    session = Session.objects.get(pk=turn.session_id)
    assert session.backend_session_id
    assert session.tokens_input >= 12 and session.tokens_output >= 34
    assert "All done" in [m.text for m in session.transcript.all()]
    status, detail = bridge["api"].call("GET", f"/sessions/{session.pk}")
    assert detail["takeover"]["backend_session_id"] == session.backend_session_id


def test_interrupt_kills_a_stop_ignoring_agent_and_its_grandchild(bridge):
    turn = start(bridge, "@ignore-stop\n@grandchild 120\n@sleep 120")
    wait_status(turn, "running")
    grandchild = int(output_value(turn, "grandchild_pid"))
    agent = Turn.objects.get(pk=turn.pk).pid
    status, answer = bridge["api"].call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "e2e"})
    assert status == 200 and answer["dispatched"] is True
    # How fast the tree goes is P2's figure (bench/interrupt_latency.py), not a wall-clock assert here.
    turn = wait_until(lambda: (t := Turn.objects.get(pk=turn.pk)).stop_state == "confirmed" and t,
                      timeout=SIGINT_TIMEOUT_S + 30, message="a confirmed stop")
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    assert not alive(agent) and not alive(grandchild)
    kinds = [e.data.get("stop_state") for e in Event.objects.filter(stream=turn.stream, kind="turn.stop_state")]
    assert "signalled" in kinds and "escalated" in kinds


def test_wake_errors_and_secrets(bridge, viewer):
    cases = {
        "exit": ("@stderr failing now\n@exit 3", "exited_nonzero"),
        "signal": ("@signal SEGV", "signal"),
        "fail-start": ("@fail-start", "spawn_failed"),
    }
    for name, (prompt, kind) in cases.items():
        turn = start(bridge, prompt, idea_key=f"idea:{name}", acknowledge_changes=True)
        turn = wait_status(turn, "interrupted")
        assert turn.interrupted_reason == "crash", name
        assert turn.wake_error["kind"] == kind, (name, turn.wake_error)
        assert turn.wake_error["summary"]
    exited = Turn.objects.get(session__idea_key="idea:exit")
    assert exited.wake_error["exit_code"] == 3 and "failing now" in exited.wake_error["details"]
    assert Turn.objects.get(session__idea_key="idea:signal").wake_error["signal"] in ("SIGSEGV", "SEGV")

    secret = start(bridge, f"@stderr OPENAI_API_KEY={CANARY}\n@exit 2", idea_key="idea:canary",
                   acknowledge_changes=True)
    secret = wait_status(secret, "interrupted")
    assert "[REDACTED]" in secret.wake_error["details"]
    stored = json.dumps([list(Turn.objects.values()), list(Event.objects.values("data"))], default=str)
    assert CANARY not in stored
    _t, raw = token_create(user=viewer, name="viewer")
    status, body = Api(bridge["portal"], raw).call("GET", f"/turns/{secret.pk}")
    assert status == 200 and body["wake_error"]["details"] is None and body["wake_error"]["summary"]


def test_invalid_path_is_reported_by_the_daemon(bridge):
    missing = bridge["workspace"] / "does-not-exist"
    status, body = bridge["api"].call("POST", "/sessions", {
        "connection": str(bridge["connection"].pk), "cwd": str(missing), "prompt": "@reply never"})
    assert status == 201, body
    turn = wait_status(Turn.objects.get(pk=body["turn"]), "interrupted")
    assert turn.interrupted_reason == "invalid_path"
    assert turn.wake_error["kind"] == "invalid_path"


def test_daemon_killed_mid_turn_then_mark_interrupted_and_resume(bridge, tmp_path):
    turn = start(bridge, "@sleep 300\nLong work")
    wait_status(turn, "running")
    agent_pid = Turn.objects.get(pk=turn.pk).pid
    session = Session.objects.get(pk=turn.session_id)
    wait_until(lambda: Session.objects.get(pk=session.pk).backend_session_id, timeout=20,
               message="the agent's session id")
    bridge["daemon"].kill()
    kill_group(agent_pid)  # the machine "lost" the agent with its daemon
    wait_until(lambda: Connection.objects.get(pk=bridge["connection"].pk).status == "offline", timeout=30,
               message="the connection to go offline")
    # Resume while offline: 409, nothing changes.
    turns_before = Turn.objects.filter(session=session).count()
    status, body = bridge["api"].call("POST", f"/sessions/{session.pk}/resume", {"context": "go on"})
    assert status == 409 and body["error"]["code"] in ("connection_offline", "invalid_transition")
    assert Turn.objects.filter(session=session).count() == turns_before
    # Mark interrupted: settled with the evidence recorded.
    status, body = bridge["api"].call("POST", f"/turns/{turn.pk}/mark-interrupted", {"reason": "daemon died"})
    assert status == 200, body
    turn = Turn.objects.get(pk=turn.pk)
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    assert turn.interrupt_evidence["basis"] in ("connection_offline", "heartbeat_stale")
    status, body = bridge["api"].call("POST", f"/sessions/{session.pk}/resume", {"context": "go on"})
    assert status == 409 and body["error"]["code"] == "connection_offline"
    # The daemon returns: resume runs on the same cwd with the agent's own session id.
    bridge["daemon"].start()
    wait_online(bridge["connection"])
    status, body = bridge["api"].call("POST", f"/sessions/{session.pk}/resume", {"context": "@reply resumed"})
    assert status == 200, body
    resumed = wait_status(Turn.objects.get(pk=body["turn"]), "ended", timeout=60)
    assert resumed.trigger == "resume"
    session.refresh_from_db()
    assert session.cwd == str(bridge["workspace"])
    command = resumed.commands.get(action="resume")
    assert command.payload["backend_session_id"] == session.backend_session_id


def test_stale_connection_is_swept_offline_within_the_timeout(bridge):
    turn = start(bridge, "@sleep 300")
    wait_status(turn, "running")
    agent_pid = Turn.objects.get(pk=turn.pk).pid
    bridge["daemon"].kill()
    kill_group(agent_pid)
    turn = wait_status(turn, "interrupted", timeout=20 + 10 + 30)
    assert turn.interrupted_reason == "offline"
    assert turn.interrupt_evidence.get("basis") == "heartbeat_stale"


def test_a_report_made_while_the_portal_is_down_arrives_once(bridge, tmp_path):
    turn = start(bridge, "@sleep 3\n@reply finished while you were away")
    wait_status(turn, "running")
    port = int(bridge["portal"].rsplit(":", 1)[1])
    stop_process(bridge["portal"].process)  # the portal goes down mid-turn
    wait_until(lambda: any((tmp_path / "spool").rglob("0*.json")), timeout=30, message="a spooled report")
    agent_pid = Turn.objects.get(pk=turn.pk).pid
    wait_until(lambda: not alive(agent_pid), timeout=30, message="the agent to finish")
    assert Turn.objects.get(pk=turn.pk).status == "running"
    restarted = start_portal(port, tmp_path, name="daphne-restarted")
    try:
        ended = wait_status(turn, "ended", timeout=60)
        assert ended.final_reply == "finished while you were away"
        statuses = [e.data.get("status") for e in Event.objects.filter(stream=turn.stream, kind="turn.status")]
        assert statuses.count("ended") == 1
    finally:
        stop_process(restarted)
