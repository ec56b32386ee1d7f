"""Real Codex (the pinned npm release) through the real portal, Celery and daemon, against the model
stand-in's Responses API (issue 10). docs/daemon-backends.md says which observation each test proves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from sessions_app.models import Session, Turn
from tests.e2e.conftest import wait_until
from tests.e2e.real_cli import (
    api_retrying,
    group_processes,
    message,
    progress_messages,
    real_cli,  # noqa: F401 — fixture
    resume,
    standin,  # noqa: F401 — fixture
    start,
    wait_status,
)
from tests.model_standin import Reply, Tool

pytestmark = [pytest.mark.django_db(transaction=True)]

PATCH = "*** Begin Patch\n*** Add File: patched.txt\n+made by apply_patch\n*** End Patch\n"


@pytest.fixture
def codex(real_cli):  # noqa: F811
    return real_cli("codex")


def said(request) -> str:
    return json.dumps(request.body.get("input"))


def test_turn_with_shell_and_apply_patch_then_the_next_message_in_the_same_thread(codex):
    ws, model = codex["workspace"], codex["standin"]
    model.script(Reply(tools=[Tool("exec_command", {"cmd": "echo from-shell > shell.txt"})], usage=(100, 20, 30, 0)),
                 Reply(tools=[Tool("apply_patch", {"input": PATCH})]),
                 Reply(text="Codex finished.", usage=(40, 8, 0, 0)))
    turn = wait_status(start(codex, "Make two files."), "ended", bridge=codex)
    assert turn.final_reply == "Codex finished."
    assert (ws / "shell.txt").read_text().strip() == "from-shell"
    assert (ws / "patched.txt").read_text().strip() == "made by apply_patch"
    changes = json.dumps(turn.changes)
    assert "shell.txt" in changes and "patched.txt" in changes
    session = Session.objects.get(pk=turn.session_id)
    assert session.backend_session_id  # the thread id of thread.started
    assert session.tokens_output >= 28 and session.tokens_cache_read >= 30
    assert "Codex finished." in [m.text for m in session.transcript.all()]
    first = model.agent_requests()[0]
    assert first.headers.get("authorization") == "Bearer standin-key-0000" and "Make two files." in said(first)

    model.script(Reply(text="Still the same thread."))
    again = wait_status(message(codex, session.pk, "And now?"), "ended", bridge=codex)
    assert again.final_reply == "Still the same thread."
    assert again.commands.get().payload["backend_session_id"] == session.backend_session_id
    output_first = session.tokens_output
    session.refresh_from_db()
    # Codex reports a resumed thread's running total; the turn adds only its own 7 output tokens.
    assert session.tokens_output == output_first + 7
    last = model.agent_requests()[-1]
    assert "Make two files." in said(last) and "Codex finished." in said(last) and "And now?" in said(last)
    # The take-over command, run as the API shows it in the session's cwd, continues the thread.
    status, detail = codex["api"].call("GET", f"/sessions/{session.pk}")
    command = detail["takeover"]["command"]
    assert session.backend_session_id in command
    model.script(Reply(text="Taken over by hand."))
    env = {**codex["daemon"].env, "PATH": os.path.dirname(codex["binary"]) + os.pathsep + os.environ["PATH"]}
    by_hand = subprocess.run(command, shell=True, cwd=ws, env=env, input="Typed by the operator.",
                             capture_output=True, text=True, timeout=120)
    assert by_hand.returncode == 0, by_hand.stderr[-2000:]
    last = model.agent_requests()[-1]
    assert "Typed by the operator." in said(last) and "Still the same thread." in said(last)


def test_interrupt_of_a_first_turn_keeps_the_thread_id_for_resume(codex):
    model = codex["standin"]
    model.script(Reply(text="Partial", hang=True))
    turn = start(codex, "Think hard.")
    wait_status(turn, "running", bridge=codex)
    wait_until(lambda: model.agent_requests(), timeout=60, message="Codex to call the model")
    session = Session.objects.get(pk=turn.session_id)
    pid = Turn.objects.get(pk=turn.pk).pid
    status, answer = codex["api"].call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "e2e"})
    assert status == 200 and answer["dispatched"] is True
    turn = wait_until(lambda: (t := Turn.objects.get(pk=turn.pk)).stop_state == "confirmed" and t, timeout=60,
                      message="a confirmed stop")
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    assert group_processes(pid) == []  # the Node launcher, the native binary and its helpers
    session.refresh_from_db()
    thread = session.backend_session_id
    assert thread  # a first turn stopped before exit 0 keeps its thread id

    model.script(Reply(text="Resumed the thread."))
    again = wait_status(resume(codex, session.pk, "Go on."), "ended", bridge=codex)
    assert again.final_reply == "Resumed the thread."
    assert again.commands.get().payload["backend_session_id"] == thread
    assert "Think hard." in said(model.agent_requests()[-1])


def test_wake_errors_and_retries_name_the_cause(codex):
    model, home = codex["standin"], codex["home"]
    model.script(Reply(status=401, repeat=True))
    turn = wait_status(start(codex, "hello", idea_key="idea:401"), "interrupted", timeout=90, bridge=codex)
    assert turn.interrupted_reason == "crash"
    assert turn.wake_error["kind"] == "auth", turn.wake_error
    assert "rejected the API key (401" in turn.wake_error["summary"]
    assert "retrying: authentication failed (attempt 1 of 1)" in progress_messages(turn)
    model._script.clear()

    model.script(Reply(text="first"))
    first = wait_status(start(codex, "hello", idea_key="idea:gone", acknowledge_changes=True), "ended", bridge=codex)
    shutil.rmtree(home / ".codex" / "sessions")
    gone = wait_status(message(codex, first.session_id, "again"), "interrupted", timeout=60, bridge=codex)
    assert gone.interrupted_reason == "crash"
    assert "no thread" in gone.wake_error["summary"] and "new session" in gone.wake_error["summary"], gone.wake_error

    # The model server is down: Codex waits for the network for ever, visibly; the operator's stop ends it.
    model.close()
    down = start(codex, "hello", idea_key="idea:down", acknowledge_changes=True)
    # The turn says so live (the API; the pages as for Claude) until the operator's stop ends it.
    wait_until(lambda: (r := api_retrying(codex, down)) and r["message"] ==
               "retrying: model API unreachable, waiting for network", timeout=60, message="Codex's reconnect notice")
    pid = Turn.objects.get(pk=down.pk).pid
    status, _ = codex["api"].call("POST", f"/turns/{down.pk}/interrupt", {"reason": "model server down"})
    assert status == 200
    down = wait_until(lambda: (t := Turn.objects.get(pk=down.pk)).stop_state == "confirmed" and t, timeout=60,
                      message="a confirmed stop")
    assert (down.status, down.interrupted_reason) == ("interrupted", "user")
    assert group_processes(pid) == [] and api_retrying(codex, down) is None
