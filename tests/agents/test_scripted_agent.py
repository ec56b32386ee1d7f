"""The scripted agent as a real subprocess (SPEC §5.1), started the way the daemon starts it: from the
scripted backend's LaunchSpec, in its own process group, in a temporary cwd, with its sessions in a
temporary CHORUS_SCRIPTED_HOME. Waits are conditions with deadlines, never fixed sleeps."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agents.backends import get_backend, summarise_events
from agents.protocol import EV_ERROR, EV_PROGRESS, EV_TOOL

DEADLINE_S = 15


def wait_until(condition, timeout=DEADLINE_S, interval=0.02, message="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message}")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies excluded) whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def kill_and_wait(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_until(lambda: not alive(pid), message=f"pid {pid} to be gone")


class AgentRun:
    """One run of the scripted agent, its stdout read line by line as it comes."""

    backend = get_backend("scripted")

    def __init__(self, prompt, cwd, home, session_id=None, env=None):
        spec = self.backend.command(prompt=prompt, cwd=str(cwd), backend_session_id=session_id, env=env or {})
        environ = {**os.environ, **spec.env, "CHORUS_SCRIPTED_HOME": str(home)}
        for key in ("CHORUS_API_URL", "CHORUS_TASK_TOKEN", "CHORUS_ATTEMPT_ID", "CHORUS_RUN_ID", "CHORUS_ISSUE_ID"):
            if key not in spec.env:
                environ.pop(key, None)
        self.proc = subprocess.Popen(spec.argv, cwd=spec.cwd, env=environ, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.lines: list[str] = []
        self.stderr = b""
        self._out = threading.Thread(target=self._read_stdout, daemon=True)
        self._err = threading.Thread(target=self._read_stderr, daemon=True)
        self._out.start()
        self._err.start()
        self.proc.stdin.write(spec.stdin.encode())
        self.proc.stdin.close()

    def _read_stdout(self):
        for raw in self.proc.stdout:
            self.lines.append(raw.decode())

    def _read_stderr(self):
        self.stderr = self.proc.stderr.read()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def objects(self) -> list[dict]:
        return [json.loads(line) for line in list(self.lines)]

    def wait_for(self, predicate, message="an output line") -> dict:
        return wait_until(lambda: next((o for o in self.objects() if predicate(o)), None), message=message)

    def wait(self, timeout=DEADLINE_S) -> int:
        code = self.proc.wait(timeout)
        self._out.join(timeout)
        self._err.join(timeout)
        return code

    def events(self):
        return self.backend.parse_output("".join(self.lines))

    def summary(self):
        return summarise_events(self.events())


@pytest.fixture
def workdir(tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    return cwd


@pytest.fixture
def home(tmp_path):
    return tmp_path / "scripted-home"


@pytest.fixture
def run(workdir, home):
    started: list[AgentRun] = []

    def start(prompt, session_id=None, env=None):
        agent = AgentRun(prompt, workdir, home, session_id, env)
        started.append(agent)
        return agent

    yield start
    for agent in started:  # never leave a process group behind, even when a test failed half-way
        if agent.proc.poll() is None or group_members(agent.pid):
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.proc.wait(DEADLINE_S)


def session_file(home, session_id) -> dict:
    return json.loads((home / f"{session_id}.json").read_text())


# ------------------------------------------------------------------------------------ replies

def test_reply_write_and_usage(run, workdir, home):
    agent = run("Please write the greeting.\n@write out/greeting.txt hello world\n@usage 12 5\n@reply all done")
    assert agent.wait() == 0
    summary = agent.summary()
    assert summary["final_reply"] == "all done"
    assert summary["usage"] == {"input": 12, "output": 5, "cache_read": 0, "cache_write": 0}
    assert [e.data for e in agent.events() if e.kind == EV_TOOL] == [
        {"name": "write", "input": {"path": "out/greeting.txt", "bytes": 12}}]
    assert (workdir / "out" / "greeting.txt").read_text() == "hello world\n"
    session = session_file(home, summary["backend_session_id"])
    assert session["turns"] == 1 and [m["role"] for m in session["messages"]] == ["user", "assistant"]
    assert agent.objects()[0] == {"type": "session", "id": summary["backend_session_id"]}  # the first line


def test_default_reply_and_usage(run):
    agent = run("Summarise the open issues.\n@alice is not a directive")
    assert agent.wait() == 0
    summary = agent.summary()
    assert summary["final_reply"] == "Acknowledged: Summarise the open issues.\n@alice is not a directive"
    assert summary["usage"]["input"] > 0 and summary["usage"]["output"] > 0


def test_resume_continues_the_same_session(run, home):
    first = run("Remember the number 7.\n@reply noted")
    assert first.wait() == 0
    session_id = first.summary()["backend_session_id"]
    second = run("What was it?\n@reply", session_id=session_id)
    assert second.wait() == 0
    summary = second.summary()
    assert summary["backend_session_id"] == session_id
    assert summary["final_reply"] == "turn 2"
    assert {"message": "turn 2", "turn": 2, "resumed": True} in [e.data for e in second.events()
                                                                 if e.kind == EV_PROGRESS]
    session = session_file(home, session_id)
    assert session["turns"] == 2
    assert [(m["role"], m["turn"]) for m in session["messages"]] == [
        ("user", 1), ("assistant", 1), ("user", 2), ("assistant", 2)]
    assert session["messages"][2]["content"].startswith("What was it?")


def test_resume_of_an_unknown_session_fails(run):
    agent = run("hello", session_id="no-such-session")
    assert agent.wait() == 1
    assert agent.summary()["errors"] == [{"message": "no such session: no-such-session"}]
    assert b"no such session" in agent.stderr


# ------------------------------------------------------------------------- crashes and exits

def test_exit_code_and_stderr(run):
    agent = run("@stderr boom: disk full\n@exit 3\n@reply never")
    assert agent.wait() == 3
    assert b"boom: disk full\n" in agent.stderr
    assert agent.summary()["final_reply"] is None


def test_exit_zero_still_replies(run):
    agent = run("@reply fine\n@exit 0\n@reply not reached")
    assert agent.wait() == 0
    assert agent.summary()["final_reply"] == "fine"


def test_signal_kills_the_agent(run):
    agent = run("@signal SEGV")
    assert agent.wait() == -signal.SIGSEGV
    assert agent.summary()["backend_session_id"]


def test_fail_start_prints_nothing(run, home):
    agent = run("do the thing\n@reply ok\n@fail-start")
    assert agent.wait() == 127
    assert agent.lines == []
    assert b"not logged in" in agent.stderr
    assert not home.exists() or not list(home.iterdir())  # no session was made


def test_malformed_directive_is_refused(run):
    agent = run("@sleep soon")
    assert agent.wait() == 2
    assert agent.summary()["errors"][0]["message"].startswith("@sleep needs a number")


@pytest.mark.parametrize("target", ["../escaped.txt", "/tmp/chorus-scripted-escape.txt", "link/escaped.txt",
                                    "."])
def test_write_outside_the_cwd_is_refused(run, workdir, tmp_path, target):
    (workdir / "link").symlink_to(tmp_path)
    agent = run(f"@write {target} nope\n@reply written")
    assert agent.wait() == 2
    summary = agent.summary()
    assert summary["final_reply"] is None and summary["tools"] == 0
    assert "outside the working directory" in summary["errors"][0]["message"]
    assert not (tmp_path / "escaped.txt").exists()
    assert not Path("/tmp/chorus-scripted-escape.txt").exists()


# ------------------------------------------------------------------------------ stopping

def test_sleep_reports_progress_every_second(run):
    agent = run("@sleep 2.3\n@reply rested")
    assert agent.wait() == 0
    ticks = [e.data.get("elapsed_s") for e in agent.events() if e.kind == EV_PROGRESS and e.data["message"] == "working"]
    assert ticks == [1, 2]
    assert agent.summary()["final_reply"] == "rested"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_ends_the_turn_with_130(run, sig, home):
    agent = run("@sleep 60")
    agent.wait_for(lambda o: o.get("message", "").startswith("working for"), "the sleep to start")
    os.kill(agent.pid, sig)
    assert agent.wait() == 130
    assert agent.objects()[-1] == {"type": "progress", "message": "stopping", "signal": sig.name}
    session = session_file(home, agent.summary()["backend_session_id"])
    assert session["messages"][-1] == {"role": "assistant", "turn": 1, "content": "[stopped]"}


def test_ignore_stop_survives_sigint_and_sigterm_until_the_group_is_killed(run):
    agent = run("@ignore-stop\n@grandchild 60\n@sleep 60")
    child = agent.wait_for(lambda o: "grandchild_pid" in o, "the grandchild")["grandchild_pid"]
    agent.wait_for(lambda o: o.get("message", "").startswith("working for"), "the sleep to start")
    os.kill(agent.pid, signal.SIGINT)
    os.kill(agent.pid, signal.SIGTERM)
    signalled_at = len(agent.lines)
    # Still at work: a progress tick written after both signals were sent.
    agent.wait_for(lambda o: o.get("message") == "working" and agent.objects().index(o) >= signalled_at,
                   "a progress tick after the stop signals")
    assert agent.proc.poll() is None and alive(child)
    os.killpg(agent.pid, signal.SIGKILL)  # only a group kill stops it
    assert agent.wait() == -signal.SIGKILL
    wait_until(lambda: not group_members(agent.pid), message="the whole group to be gone")
    assert not alive(child)


# -------------------------------------------------------------------------- descendants

def test_grandchild_stays_in_the_agent_process_group(run):
    agent = run("@grandchild 60\n@reply spawned")
    assert agent.wait() == 0
    child = next(o["grandchild_pid"] for o in agent.objects() if "grandchild_pid" in o)
    try:
        assert alive(child)  # the agent has exited; its grandchild has not
        assert os.getpgid(child) == agent.pid  # the agent leads its own group (start_new_session)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
    wait_until(lambda: not alive(child), message="the grandchild to die with the group")


def test_escape_child_leaves_the_group(run):
    agent = run("@escape 60\n@reply escaped")
    assert agent.wait() == 0
    child = next(o["escape_pid"] for o in agent.objects() if "escape_pid" in o)
    try:
        wait_until(lambda: os.getsid(child) == child, message="the child to start its own session")
        assert os.getpgid(child) != agent.pid
        assert group_members(agent.pid) == []  # a group kill would not reach it; it lives on
        assert alive(child)
    finally:
        kill_and_wait(child)


def test_background_process_outlives_the_agent(run):
    agent = run("@background 60\n@reply left something running")
    assert agent.wait() == 0
    assert agent.summary()["final_reply"] == "left something running"
    child = next(o["background_pid"] for o in agent.objects() if "background_pid" in o)
    try:
        assert alive(child)
        assert os.getsid(child) == child
    finally:
        kill_and_wait(child)


# ----------------------------------------------------------------------- requires_action

def test_require_approval_waits_and_the_answer_resumes(run, home):
    agent = run("Deploy when ready.\n@require-approval Deploy v2 to production?\n@reply deployed")
    assert agent.wait() == 0
    summary = agent.summary()
    assert summary["requires_action"] == {"kind": "confirmation",
                                          "items": [{"id": "req-1-1", "text": "Deploy v2 to production?"}]}
    assert summary["final_reply"] is None
    session_id = summary["backend_session_id"]
    assert session_file(home, session_id)["pending"]["items"][0]["id"] == "req-1-1"

    answer = run("approved\n@reply deployed", session_id=session_id)
    assert answer.wait() == 0
    progress = [e.data for e in answer.events() if e.kind == EV_PROGRESS]
    assert {"message": "answer received", "answered": ["req-1-1"], "kind": "confirmation",
            "answer": "approved"} in progress
    assert answer.summary()["final_reply"] == "deployed"
    assert session_file(home, session_id)["pending"] is None


def test_await_tool_is_an_external_execution(run):
    agent = run("@await-tool run_migrations")
    assert agent.wait() == 0
    assert agent.summary()["requires_action"] == {"kind": "external_execution",
                                                  "items": [{"id": "req-1-1", "text": "run_migrations"}]}


# ---------------------------------------------------------------------------- talking back

class Recorder(http.server.BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append((self.path, self.headers.get("Authorization"), json.loads(body)))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def portal():
    Recorder.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api/v1", Recorder.requests
    server.shutdown()
    server.server_close()


def test_outcome_member_comment_artifact_are_posted_with_the_task_token(run, portal):
    url, requests = portal
    env = {"CHORUS_API_URL": url, "CHORUS_TASK_TOKEN": "tok-123", "CHORUS_ATTEMPT_ID": "att-1",
           "CHORUS_RUN_ID": "run-1", "CHORUS_ISSUE_ID": "iss-1"}
    agent = run("Lead the work.\n@member api Build the API\n@comment halfway there\n@artifact report.md all good\n"
                "@reply Split the work in two.\n@outcome succeeded", env=env)
    assert agent.wait() == 0
    assert [(path, auth) for path, auth, _ in requests] == [
        ("/api/v1/runs/run-1/nodes", "Bearer tok-123"), ("/api/v1/issues/iss-1/comments", "Bearer tok-123"),
        ("/api/v1/artifacts", "Bearer tok-123"), ("/api/v1/attempts/att-1/outcome", "Bearer tok-123")]
    assert requests[0][2] == {"nodes": [{"key": "api", "prompt": "Build the API"}]}
    assert requests[1][2]["body"] == "halfway there"
    assert requests[2][2]["name"] == "report.md" and requests[2][2]["content"] == "all good"
    # The summary is the agent's own reply, never the prompt it was given ("Lead the work.").
    assert requests[3][2] == {"intent": "succeeded", "summary": "Split the work in two."}
    summary = agent.summary()
    assert summary["outcome"] == {"intent": "succeeded", "summary": "Split the work in two."}
    assert [t.data["name"] for t in agent.events() if t.kind == EV_TOOL] == [
        "chorus.member", "chorus.comment", "chorus.artifact"]


def test_posting_is_best_effort(run):
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"CHORUS_API_URL": f"http://127.0.0.1:{port}", "CHORUS_TASK_TOKEN": "t", "CHORUS_ATTEMPT_ID": "a"}
    agent = run("@outcome blocked DEP-9\n@reply blocked on DEP-9", env=env)
    assert agent.wait() == 0
    summary = agent.summary()
    assert summary["outcome"]["ref"] == "DEP-9" and summary["final_reply"] == "blocked on DEP-9"
    assert any(e.data["message"].startswith("outcome posted: failed") for e in agent.events() if e.kind == EV_PROGRESS)
    assert not [e for e in agent.events() if e.kind == EV_ERROR]


def test_unknown_outcome_intent_is_refused(run):
    agent = run("@outcome done")
    assert agent.wait() == 2
    assert "succeeded, failed, blocked, waiting" in agent.summary()["errors"][0]["message"]


def test_file_directives_print_what_the_prompt_does_not_carry(workdir, tmp_path):
    (workdir / "out.txt").write_text('plain line\n{"type": "text", "text": "a json line"}\n')
    (workdir / "err.txt").write_text("on stderr\n")
    (workdir / "ask.txt").write_text("Approve the file's question?\n")
    run = AgentRun("@cat out.txt\n@stderr-file err.txt\n@background 30 --flag {file:err.txt}\n"
                   "@require-approval {file:ask.txt}", workdir, tmp_path / "home")
    assert run.wait() == 0
    assert "plain line\n" in run.lines and '{"type": "text", "text": "a json line"}\n' in run.lines
    assert run.stderr.decode() == "on stderr\n"
    objects = [json.loads(line) for line in run.lines if line.startswith("{")]
    background = next(o["background_pid"] for o in objects if "background_pid" in o)
    try:
        assert open(f"/proc/{background}/cmdline").read().split("\0")[-4:-1] == ["--flag", "on", "stderr"]
    finally:
        kill_and_wait(background)
    asked = next(o for o in objects if o.get("type") == "requires_action")
    assert asked["items"][0]["text"] == "Approve the file's question?"
    missing = AgentRun("@cat nope.txt", workdir, tmp_path / "home")
    assert missing.wait() == 2
