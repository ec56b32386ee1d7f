"""Real Claude Code (the pinned npm release) through the real portal, Celery and daemon, against the
model stand-in (issue 10). docs/daemon-backends.md says which observation each test proves."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import signal
import subprocess
import threading

import pytest

from chorus_site.models import Event
from sessions_app.models import Session, Turn
from tests.e2e.conftest import admin_login, alive, wait_until
from tests.e2e.real_cli import (
    api_retrying,
    message,
    group_processes,
    progress_messages,
    real_cli,  # noqa: F401 — fixture
    resume,
    standin,  # noqa: F401 — fixture
    start,
    wait_status,
)
from tests.model_standin import Reply, Tool

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def claude(real_cli):  # noqa: F811
    return real_cli("claude_code")


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


class Terminal:
    """A command run under a pseudo-terminal (the take-over is Claude Code's interactive TUI), its
    screen output collected by a thread so the TUI never blocks on a full pty."""

    def __init__(self, command: str, *, cwd, env: dict[str, str]):
        master, slave = pty.openpty()
        self.master, self.output = master, bytearray()
        self.proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, env=env, stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True)
        os.close(slave)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.output.extend(chunk)

    def screen(self) -> str:
        """What was printed, escape sequences and whitespace removed (the TUI moves the cursor
        instead of printing spaces)."""
        text = re.sub(rb"\x1b(\[[0-9;?<>=]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[()][0-9A-Za-z]|.)", b"",
                      bytes(self.output)).decode("utf-8", "replace")
        return re.sub(r"\s+", "", text)

    def wait_for(self, predicate, *, timeout: float, message: str):
        """``wait_until`` that shows the end of the screen when it times out."""
        try:
            return wait_until(predicate, timeout=timeout, message=message)
        except AssertionError as error:
            raise AssertionError(f"{error}; screen: {self.screen()[-600:]}") from None

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def end(self) -> bool:
        """Ctrl-C twice, as an operator leaves the TUI: True if it exited so, else it is killed
        (no raising here: a failure earlier in the test stays the one reported)."""
        try:
            self.type("\x03")
            wait_until(lambda: "again" in self.screen(), timeout=5, message="'press Ctrl-C again to exit'")
            self.type("\x03")
            wait_until(lambda: self.proc.poll() is not None, timeout=10, message="the TUI to exit on Ctrl-C")
            return True
        except (AssertionError, OSError):
            return False
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            os.close(self.master)


def accept_first_run_dialogs(home, cwd: str, api_key: str) -> None:
    """What an operator answers once on the daemon's user the first time they run ``claude``
    interactively; 2.1.328 keeps it in ``~/.claude.json`` (``$CLAUDE_CONFIG_DIR/.claude.json``):
    onboarding done (else the TUI opens on a connectivity check of api.anthropic.com, which fails
    behind a gateway), the API key from the environment approved (its last 20 characters), the
    folder trusted. ``claude -p`` asks none of this, so the daemon's runs leave them unset."""
    path = home / ".claude.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config["hasCompletedOnboarding"] = True
    config["customApiKeyResponses"] = {"approved": [api_key[-20:]], "rejected": []}
    config.setdefault("projects", {}).setdefault(cwd, {})["hasTrustDialogAccepted"] = True
    path.write_text(json.dumps(config))


def test_the_takeover_command_run_as_printed_in_a_terminal_continues_the_conversation(claude):
    ws, model = claude["workspace"], claude["standin"]
    model.script(Reply(text="Earlier answer from the daemon's turn."))
    turn = wait_status(start(claude, "First question through the portal."), "ended", bridge=claude)
    session = Session.objects.get(pk=turn.session_id)
    status, detail = claude["api"].call("GET", f"/sessions/{session.pk}")
    assert status == 200
    command = detail["takeover"]["command"]
    assert command == f"cd {ws} && claude --resume {session.backend_session_id}"

    # The operator, as the daemon's user with its environment (base URL, key, HOME), in a terminal.
    accept_first_run_dialogs(claude["home"], str(ws), claude["daemon"].env["ANTHROPIC_API_KEY"])
    env = {**claude["daemon"].env, "TERM": "xterm-256color",
           "PATH": os.path.dirname(claude["binary"]) + os.pathsep + os.environ["PATH"]}
    model.script(Reply(text="Taken over by hand."))
    calls = len(model.agent_requests())
    terminal = Terminal(command, cwd="/", env=env)
    try:
        # The TUI shows the resumed conversation, then reads the operator's message.
        terminal.wait_for(lambda: "Earlieranswerfromthedaemon'sturn." in terminal.screen(), timeout=20,
                          message="the TUI to show the resumed conversation")
        terminal.type("Typed by the operator.")
        terminal.wait_for(lambda: "Typedbytheoperator." in terminal.screen(), timeout=10, message="the typed message")
        terminal.type("\r")
        asked = terminal.wait_for(lambda: next((r for r in model.agent_requests()[calls:]
                                                if "Typed by the operator." in said(r)), None), timeout=20,
                                  message="the TUI to call the model")
        assert "First question through the portal." in said(asked)
        assert "Earlier answer from the daemon's turn." in said(asked)
        assert session.backend_session_id in asked.body["metadata"]["user_id"]  # the same session
        terminal.wait_for(lambda: "Takenoverbyhand." in terminal.screen(), timeout=10, message="the reply on screen")
    finally:
        left_with_ctrl_c = terminal.end()
    assert left_with_ctrl_c and group_processes(terminal.proc.pid) == []  # the TUI and its helpers are gone


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


STUBBORN_HOOK = """#!/bin/sh
trap '' INT TERM
echo $$ > {pid_file}
sleep 300
"""


def test_interrupt_reaches_a_tool_that_ignores_the_stop_and_a_cli_that_does_not_exit(claude):
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

    # A CLI that does not exit on SIGINT: with a SessionEnd hook that ignores signals, Claude Code
    # answers the stop (it prints its result) but waits for its hooks; the daemon kills the tree.
    hook, hook_pid_file = ws.parent / "session-end-hook.sh", ws.parent / "hook.pid"
    hook.write_text(STUBBORN_HOOK.format(pid_file=hook_pid_file))
    hook.chmod(0o755)
    (claude["home"] / ".claude" / "settings.json").write_text(json.dumps({"hooks": {"SessionEnd": [
        {"matcher": "", "hooks": [{"type": "command", "command": str(hook), "timeout": 300}]}]}}))
    model._script.clear()
    model.script(Reply(text="Partial, then the stream hangs", hang=True))
    calls = len(model.agent_requests())
    deaf = start(claude, "Think for a long time.", idea_key="idea:deaf", acknowledge_changes=True)
    wait_until(lambda: len(model.agent_requests()) > calls, timeout=60, message="Claude Code to call the model")
    pid = Turn.objects.get(pk=deaf.pk).pid
    status, _ = claude["api"].call("POST", f"/turns/{deaf.pk}/interrupt", {"reason": "e2e"})
    assert status == 200
    wait_until(lambda: hook_pid_file.exists() and hook_pid_file.read_text().strip(), timeout=30,
               message="the CLI to run its SessionEnd hook")
    hook_pid = int(hook_pid_file.read_text())
    deaf = wait_until(lambda: (t := Turn.objects.get(pk=deaf.pk)).stop_state == "confirmed" and t, timeout=60,
                      message="a confirmed stop")
    assert (deaf.status, deaf.interrupted_reason) == ("interrupted", "user")
    stages = [e.data.get("stop_state") for e in Event.objects.filter(stream=deaf.stream, kind="turn.stop_state",
                                                                     data__id=str(deaf.pk)).order_by("id")]
    assert "escalated" in stages  # SIGINT did not end it: the daemon killed the tree after the timeout
    assert group_processes(pid) == [] and not alive(hook_pid)


def test_wake_errors_name_the_cause(claude):
    model, home = claude["standin"], claude["home"]
    # A refused key: the CLI retries (visible as progress), then the turn crashes naming the cause.
    model.script(Reply(status=401, repeat=True))
    turn = wait_status(start(claude, "hello", idea_key="idea:401"), "interrupted", timeout=90, bridge=claude)
    assert turn.interrupted_reason == "crash"
    assert turn.wake_error["kind"] == "auth", turn.wake_error
    assert "API key" in turn.wake_error["summary"] and "401" in turn.wake_error["summary"]
    assert any(m.startswith("retrying: authentication failed (attempt 1 of 2") for m in progress_messages(turn))
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
    # The partial reply is in the turn's output and stays in the session's transcript, marked.
    assert "Let me look first." in [str((e.data.get("data") or {}).get("text")) for e in
                                    Event.objects.filter(stream=killed.stream, kind="turn.output")]
    assert transcript_of(killed)[-1] == ("assistant", "Let me look first.\n\n[partial reply: the turn was "
                                                      "interrupted (crash) before it finished]")

    # The stream drops mid-reply after a first step: the CLI retries, gives up (no partial message of
    # the dropped stream is printed by 2.1.328), and the reply of the first step stays in the transcript.
    model.script(Reply(text="Step one done.", tools=[Tool.bash("true")]), Reply(text="Step two is", drop=True,
                                                                                 repeat=True))
    dropped = wait_status(start(claude, "hello", idea_key="idea:dropped", acknowledge_changes=True), "interrupted",
                          timeout=60, bridge=claude)
    assert dropped.interrupted_reason == "crash", dropped.wake_error
    assert transcript_of(dropped)[-1][1].startswith("Step one done.\n\n[partial reply")
    model._script.clear()

    # The model server is down: connection refused, in words.
    model.close()
    down = wait_status(start(claude, "hello", idea_key="idea:down", acknowledge_changes=True), "interrupted",
                       timeout=90, bridge=claude)
    assert down.interrupted_reason == "crash" and "cannot be reached" in down.wake_error["summary"], down.wake_error
    assert "Connection refused" in down.wake_error["details"] or "ECONNREFUSED" in down.wake_error["details"]


def test_the_cli_retrying_shows_live_and_the_operator_can_stop_it(claude, browser, operator):
    """Claude Code retries a refused call itself (``api_retry`` lines): the turn page, the changelist
    and the API say so while it does, follow each new attempt, clear when the model answers, and
    an interrupt during the retries is a confirmed stop."""
    ws, model, api, portal = claude["workspace"], claude["standin"], claude["api"], claude["portal"]
    # Each refusal is held until the test has looked at what the previous retry line produced.
    page_open, second, answered = threading.Event(), threading.Event(), threading.Event()
    model.script(Reply(status=401, gate=page_open), Reply(status=401, gate=second),
                 Reply(tools=[Tool.bash("while [ ! -f go ]; do sleep 0.05; done")], gate=answered),
                 Reply(text="Recovered."))
    turn = start(claude, "Retry for me.")
    context = browser.new_context()
    page, changelist = context.new_page(), context.new_page()
    admin_login(page, portal, operator)
    page.goto(f"{portal}/admin/sessions_app/turn/{turn.pk}/change/")
    changelist.goto(f"{portal}/admin/sessions_app/turn/")
    for live in (page, changelist):
        live.wait_for_selector("#chorus-live-status[data-state=live]")
    retrying = f'[data-live-id="{turn.pk}"][data-live-field="retrying"]'

    def api_retrying_now():
        return api_retrying(claude, turn)

    page_open.set()  # the first refusal: "attempt 1 of 2" (CLAUDE_CODE_MAX_RETRIES=2)
    for live in (page, changelist):
        live.wait_for_function("s => (document.querySelector(s) || {}).textContent?.includes('attempt 1 of 2')",
                               arg=retrying)
    shown = page.text_content(retrying)
    assert shown.startswith("retrying: authentication failed (attempt 1 of 2, next in ") and shown.endswith(" s)")
    now = wait_until(api_retrying_now, timeout=10, message="the API to say the turn is retrying")
    assert now["message"] == shown and (now["attempt"], now["max_retries"], now["error_status"]) == (1, 2, 401)
    assert now["error"] == "authentication_failed" and now["next_attempt_at"] >= now["since"]
    status, listed = api.call("GET", f"/sessions/{turn.session_id}/turns")
    assert [t["retrying"]["message"] for t in listed["items"]] == [shown]

    second.set()  # the next line updates the same places
    page.wait_for_function("s => document.querySelector(s).textContent.includes('attempt 2 of 2')", arg=retrying)
    changelist.wait_for_function("s => document.querySelector(s).textContent.includes('attempt 2 of 2')",
                                 arg=retrying)
    assert wait_until(lambda: (r := api_retrying_now()) and r["attempt"] == 2, timeout=10, message="attempt 2")

    answered.set()  # the model answers (a tool that waits for the test): no longer retrying, still running
    for live in (page, changelist):
        live.wait_for_function("s => document.querySelector(s).hidden", arg=retrying)
    wait_until(lambda: api_retrying_now() is None, timeout=10, message="the API to clear the retrying state")
    assert Turn.objects.get(pk=turn.pk).status == "running"
    (ws / "go").write_text("")
    assert wait_status(turn, "ended", bridge=claude).final_reply == "Recovered."
    page.reload()
    assert page.is_hidden(retrying)

    # Retries the operator stops: the second refusal asks for a 30 s wait; the stop ends it at once.
    model.script(Reply(status=401), Reply(status=401, headers={"retry-after": "30"}, repeat=True))
    again = message(claude, turn.session_id, "Once more.")
    wait_until(lambda: (r := api_retrying(claude, again)) and r["attempt"] == 2, timeout=30,
               message="the second retry line")
    pid = Turn.objects.get(pk=again.pk).pid
    status, answer = api.call("POST", f"/turns/{again.pk}/interrupt", {"reason": "stop retrying"})
    assert status == 200 and answer["dispatched"] is True
    again = wait_until(lambda: (t := Turn.objects.get(pk=again.pk)).stop_state == "confirmed" and t, timeout=30,
                       message="a confirmed stop")
    assert (again.status, again.interrupted_reason) == ("interrupted", "user")
    assert group_processes(pid) == [] and api_retrying(claude, again) is None
    context.close()


def transcript_of(turn) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in Session.objects.get(pk=turn.session_id).transcript.order_by("id")]
