"""Real Claude Code (the pinned npm release) through the real portal, Celery and daemon, against the
model stand-in (issue 10). docs/daemon-backends.md says which observation each test proves."""

from __future__ import annotations

import json
import shutil

import pytest

from chorus_site.models import Event
from sessions_app.models import Session, Turn
from tests.e2e.conftest import alive, wait_until
from tests.e2e.real_cli import (
    message,
    group_processes,
    progress_messages,
    real_bridge,
    resume,
    standin,  # noqa: F401 — fixture
    start,
    stop_bridge,
    wait_status,
)
from tests.model_standin import Reply, Tool

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def claude(portal_server, celery_beat_worker, operator, workspace, tmp_path, standin):  # noqa: F811
    bridge = real_bridge("claude_code", portal_server, operator, workspace, tmp_path, standin)
    yield bridge
    stop_bridge(bridge)


def said(request) -> str:
    return json.dumps(request.body.get("messages"))


def test_turn_with_tools_then_the_next_message_in_the_same_session(claude):
    ws, model = claude["workspace"], claude["standin"]
    model.script(Reply(tools=[Tool.write(str(ws / "notes.txt"), "hello\n")], usage=(100, 20, 5, 3)),
                 Reply(tools=[Tool.edit(str(ws / "notes.txt"), "hello", "hello, edited")]),
                 Reply(tools=[Tool.bash("echo ran > bash-ran.txt")]),
                 Reply(text="All done: notes written.", usage=(50, 10, 0, 0)))
    turn = wait_status(start(claude, "Please take notes."), "ended", bridge=claude)
    assert turn.final_reply == "All done: notes written."
    assert (ws / "notes.txt").read_text() == "hello, edited\n"
    changes = json.dumps(turn.changes)
    assert "notes.txt" in changes
    session = Session.objects.get(pk=turn.session_id)
    first = model.agent_requests()[0]
    # The backend's own session id: the one Claude Code sent the model and printed.
    assert session.backend_session_id and session.backend_session_id in first.body["metadata"]["user_id"]
    assert session.tokens_input >= 150 and session.tokens_output >= 30
    assert "All done: notes written." in [m.text for m in session.transcript.all()]
    assert first.headers.get("x-api-key") == "standin-key-0000" and "Please take notes." in said(first)

    # The next message: the same Claude session, and the model sees the earlier conversation.
    model.script(Reply(text="Resumed and still here."))
    again = wait_status(message(claude, session.pk, "Now add a summary."), "ended", bridge=claude)
    assert again.final_reply == "Resumed and still here."
    assert again.commands.get().payload["backend_session_id"] == session.backend_session_id
    last = model.agent_requests()[-1]
    assert "Please take notes." in said(last) and "All done: notes written." in said(last)
    assert "Now add a summary." in said(last)
    session.refresh_from_db()
    status, detail = claude["api"].call("GET", f"/sessions/{session.pk}")
    assert detail["takeover"]["backend_session_id"] == session.backend_session_id
    assert session.backend_session_id in detail["takeover"]["command"]


def test_interrupt_mid_stream_is_confirmed_and_the_session_resumes(claude):
    model = claude["standin"]
    model.script(Reply(text="Partial answer, then silence", hang=True))
    turn = start(claude, "Think for a long time.")
    wait_status(turn, "running", bridge=claude)
    wait_until(lambda: model.agent_requests(), timeout=60, message="Claude Code to call the model")
    session = Session.objects.get(pk=turn.session_id)
    pid = Turn.objects.get(pk=turn.pk).pid
    status, answer = claude["api"].call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "e2e"})
    assert status == 200 and answer["dispatched"] is True
    turn = wait_until(lambda: (t := Turn.objects.get(pk=turn.pk)).stop_state == "confirmed" and t, timeout=60,
                      message="a confirmed stop")
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    assert group_processes(pid) == []  # the CLI and anything it started are gone
    session.refresh_from_db()
    assert session.backend_session_id  # seen before the stop, kept

    model.script(Reply(text="Picking up where we stopped."))
    again = wait_status(resume(claude, session.pk, "Go on."), "ended", bridge=claude)
    assert again.final_reply == "Picking up where we stopped."
    assert "Think for a long time." in said(model.agent_requests()[-1])


STUBBORN = """import os, signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open("stubborn.pid", "w").write(str(os.getpid()))
time.sleep(300)
"""


def test_interrupt_reaches_a_tool_that_ignores_the_stop_in_its_own_session(claude):
    ws, model = claude["workspace"], claude["standin"]
    # Claude Code runs each Bash command in a session of its own (setsid): not in the CLI's group.
    model.script(Reply(tools=[Tool.write(str(ws / "stubborn.py"), STUBBORN)]),
                 Reply(tools=[Tool.bash("python3 stubborn.py")]), Reply(text="never"))
    turn = start(claude, "Run the stubborn script.")
    wait_until(lambda: (ws / "stubborn.pid").exists() and (ws / "stubborn.pid").read_text(), timeout=60,
               message="the tool to run")
    tool_pid = int((ws / "stubborn.pid").read_text())
    status, _ = claude["api"].call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "e2e"})
    assert status == 200
    turn = wait_until(lambda: (t := Turn.objects.get(pk=turn.pk)).stop_state == "confirmed" and t, timeout=60,
                      message="a confirmed stop")
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    assert not alive(tool_pid) and group_processes(turn.pid) == []


def test_wake_errors_name_the_cause(claude):
    model, home = claude["standin"], claude["home"]
    # A refused key: the CLI retries (visible as progress), then the turn crashes naming the cause.
    model.script(Reply(status=401, repeat=True))
    turn = wait_status(start(claude, "hello", idea_key="idea:401"), "interrupted", timeout=90, bridge=claude)
    assert turn.interrupted_reason == "crash"
    assert turn.wake_error["kind"] == "auth", turn.wake_error
    assert "API key" in turn.wake_error["summary"] and "401" in turn.wake_error["summary"]
    assert any(m.startswith("retrying: authentication failed (401) (attempt 1 of 2") for m in progress_messages(turn))
    model._script.clear()

    # An overloaded model: the backend's reason, not 'ended' and not a bare exit code.
    model.script(Reply(status=529, repeat=True))
    turn = wait_status(start(claude, "hello", idea_key="idea:529", acknowledge_changes=True), "interrupted",
                       timeout=90, bridge=claude)
    assert turn.interrupted_reason == "crash" and "overloaded (529)" in turn.wake_error["summary"], turn.wake_error
    model._script.clear()

    # An unknown resume id (the CLI's session files are gone): an explicit next step.
    model.script(Reply(text="first"))
    first = wait_status(start(claude, "hello", idea_key="idea:gone", acknowledge_changes=True), "ended", bridge=claude)
    shutil.rmtree(home / ".claude" / "projects")
    gone = wait_status(message(claude, first.session_id, "again"), "interrupted", timeout=60, bridge=claude)
    assert gone.interrupted_reason == "crash"
    assert "no conversation" in gone.wake_error["summary"] and "new session" in gone.wake_error["summary"]

    # The CLI dies mid-turn (its Bash tool SIGKILLs it): a crash by signal, the partial reply kept.
    model._script.clear()
    model.script(Reply(text="Let me look first.", tools=[Tool.bash("kill -9 $PPID")]))
    killed = wait_status(start(claude, "hello", idea_key="idea:killed", acknowledge_changes=True), "interrupted",
                         timeout=60, bridge=claude)
    assert killed.interrupted_reason == "crash" and killed.wake_error["kind"] == "signal", killed.wake_error
    assert killed.wake_error["signal"] in ("SIGKILL", "KILL")
    # The partial reply is in the turn's output (the transcript takes final replies only: see the docs).
    assert "Let me look first." in [str((e.data.get("data") or {}).get("text")) for e in
                                    Event.objects.filter(stream=killed.stream, kind="turn.output")]

    # The model server is down: connection refused, in words.
    model.close()
    down = wait_status(start(claude, "hello", idea_key="idea:down", acknowledge_changes=True), "interrupted",
                       timeout=90, bridge=claude)
    assert down.interrupted_reason == "crash" and "cannot be reached" in down.wake_error["summary"], down.wake_error
    assert "Connection refused" in down.wake_error["details"] or "ECONNREFUSED" in down.wake_error["details"]
