"""One turn end to end on this machine with the real scripted agent: reports, classification of
failures, invalid paths, changes, leftovers, requires_action, time limits, interrupts."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from agents.backends.base import Backend, LaunchSpec
from agents.runner import TurnRequest, TurnRunner, cwd_problem

from .helpers import ListReporter, kill_quietly, pid_alive, wait_until


@pytest.fixture
def workdir(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    return root


@pytest.fixture
def environ(tmp_path):
    return {**os.environ, "CHORUS_SCRIPTED_HOME": str(tmp_path / "scripted-home")}


def make_runner(workdir, environ, prompt, *, cwd=None, backend=None, sigint_timeout_s=5.0, timeout_s=None,
                turn="turn-1", reporter=None):
    request = TurnRequest(turn=turn, session="session-1", cwd=str(cwd or workdir), prompt=prompt,
                          timeout_s=timeout_s, env={"CHORUS_API_URL": "http://portal.invalid/api/v1"})
    return TurnRunner(request, allowed_cwds=(str(workdir.resolve()),), default_backend="scripted",
                      sigint_timeout_s=sigint_timeout_s, reporter=reporter or ListReporter(), backend=backend,
                      environ=environ)


async def run_turn(*args, **kwargs) -> tuple[TurnRunner, ListReporter]:
    runner = make_runner(*args, **kwargs)
    await asyncio.wait_for(runner.run(), 60)
    return runner, runner.reporter


async def test_a_turn_that_ends(workdir, environ):
    runner, reports = await run_turn(workdir, environ, "@reply all done\n@write notes/a.txt hello\n@usage 10 5\nhi")
    first, final = reports.advances[0], reports.final
    assert first["status"] == "running" and first["pid"] > 0 and first["report_id"]
    assert final["status"] == "ended"
    assert final["final_reply"] == "all done"
    assert final["usage"] == {"input": 10, "output": 5, "cache_read": 0, "cache_write": 0}
    assert final["backend_session_id"]
    assert final["changes"] == {"git": False, "files": ["notes/a.txt"]}
    assert "background_processes" not in final and "wake_error" not in final
    kinds = [e["kind"] for e in reports.events_flat]
    assert kinds[0] == "session" and "tool" in kinds and kinds[-1] in ("final", "usage")
    # events are reported before the final advance (one ordered lane per turn)
    last_events = max(i for i, (kind, _) in enumerate(reports.items) if kind == "events")
    assert last_events < len(reports.items) - 1
    assert len({r["report_id"] for r in reports.advances}) == len(reports.advances)
    assert not runner.held()


async def test_git_work_tree_changes(workdir, environ):
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(workdir)], check=True)
    (workdir / "kept.txt").write_text("v1\n")
    subprocess.run([*git, "-C", str(workdir), "add", "."], check=True)
    subprocess.run([*git, "-C", str(workdir), "commit", "-qm", "init"], check=True)
    _, reports = await run_turn(workdir, environ, "@write kept.txt v2 changed\n@write new.txt fresh")
    changes = reports.final["changes"]
    assert changes["git"] is True
    assert sorted(changes["status"]) == [" M kept.txt", "?? new.txt"]
    assert "1 file changed" in changes["diff_stat"] and changes["head"]


@pytest.mark.parametrize("prompt, kind, check", [
    ("@stderr it broke badly\n@exit 3", "exited_nonzero", lambda w: w["exit_code"] == 3 and "signal" not in w),
    ("@signal SEGV", "signal", lambda w: w["signal"] == "SIGSEGV" and "exit_code" not in w),
    ("@fail-start", "spawn_failed", lambda w: w["exit_code"] == 127 and "not logged in" in w["summary"]),
])
async def test_crashes_are_classified(workdir, environ, prompt, kind, check):
    _, reports = await run_turn(workdir, environ, prompt)
    final = reports.final
    assert final["status"] == "interrupted" and final["reason"] == "crash"
    wake = final["wake_error"]
    assert wake["kind"] == kind and wake["source"] == "scripted" and check(wake), wake
    assert wake["summary"]
    if "@stderr" in prompt:
        assert "it broke badly" in wake["details"] and "it broke badly" in wake["summary"]


class MissingCli(Backend):
    name = "missing"

    def command(self, *, prompt, cwd, backend_session_id, env):
        return LaunchSpec(argv=["/nonexistent/bin/agent-cli", "-p"], stdin=prompt, env=dict(env))


async def test_an_agent_that_cannot_be_executed_is_spawn_failed(workdir, environ):
    _, reports = await run_turn(workdir, environ, "hi", backend=MissingCli())
    assert [r["status"] for r in reports.advances] == ["interrupted"]   # never "running"
    wake = reports.final["wake_error"]
    assert reports.final["reason"] == "crash" and wake["kind"] == "spawn_failed"
    assert "command not found" in wake["summary"] and "/nonexistent/bin/agent-cli" in wake["details"]


async def test_unknown_backend_is_spawn_failed(workdir, environ):
    runner = make_runner(workdir, environ, "hi")
    runner.backend_name = "no_such_cli"
    await runner.run()
    wake = runner.reporter.final["wake_error"]
    assert wake["kind"] == "spawn_failed" and "unknown backend" in wake["summary"]


@pytest.mark.parametrize("where", ["outside", "missing", "relative", "symlink-out"])
async def test_invalid_paths(workdir, environ, tmp_path, where):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    cwd = {"outside": outside, "missing": workdir / "not-there", "relative": "work",
           "symlink-out": workdir / "link"}[where]
    if where == "symlink-out":
        os.symlink(outside, workdir / "link")
    _, reports = await run_turn(workdir, environ, "@write x.txt nope", cwd=cwd)
    assert [r["status"] for r in reports.advances] == ["interrupted"]
    final = reports.final
    assert final["reason"] == "invalid_path" and final["wake_error"]["kind"] == "invalid_path"
    assert final["wake_error"]["summary"] and str(workdir.resolve()) in final["wake_error"]["details"]
    assert not (outside / "x.txt").exists()


def test_cwd_problem_accepts_subdirectories_only_of_allowed_roots(tmp_path):
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "rootless").mkdir()
    allowed = (str(tmp_path / "root"),)
    assert cwd_problem(str(tmp_path / "root"), allowed) is None
    assert cwd_problem(str(tmp_path / "root" / "sub"), allowed) is None
    assert "outside" in cwd_problem(str(tmp_path / "rootless"), allowed)  # a prefix is not a parent
    assert "outside" in cwd_problem(str(tmp_path / "root" / ".." / "rootless"), allowed)


async def test_background_process_is_reported_not_killed(workdir, environ):
    runner, reports = await run_turn(workdir, environ, "@background 60\n@reply bye")
    pid = next(e["data"]["background_pid"] for e in reports.events_flat if "background_pid" in e.get("data", {}))
    try:
        final = reports.final
        assert final["status"] == "ended"          # the turn has ended anyway (SPEC §1 rule 2)
        assert [p["pid"] for p in final["background_processes"]] == [pid]
        assert "time.sleep(60" in final["background_processes"][0]["cmdline"]
        assert pid_alive(pid)
    finally:
        kill_quietly(pid)


async def test_requires_action_at_exit(workdir, environ):
    _, reports = await run_turn(workdir, environ, "@require-approval Delete the branch?")
    statuses = [r["status"] for r in reports.advances]
    assert statuses == ["running", "requires_action"]
    final = reports.final
    assert final["requires_action"]["kind"] == "confirmation"
    assert final["requires_action"]["items"][0]["text"] == "Delete the branch?"
    assert final["backend_session_id"] and "changes" in final


async def test_time_limit(workdir, environ):
    _, reports = await run_turn(workdir, environ, "@ignore-stop\n@sleep 60", timeout_s=0.5, sigint_timeout_s=0.5)
    final = reports.final
    assert final["status"] == "interrupted" and final["reason"] == "timeout"
    assert final["wake_error"]["kind"] == "timeout" and "0.5 s" in final["wake_error"]["summary"]
    assert not [r for r in reports.advances if "stop_state" in r and "status" not in r]  # no operator stop


async def test_interrupt_is_the_verified_stop(workdir, environ):
    runner = make_runner(workdir, environ, "@ignore-stop\n@grandchild 60\n@escape 60\n@sleep 60", sigint_timeout_s=1.0)
    task = asyncio.create_task(runner.run())
    reports = runner.reporter

    def pids():
        found = {}
        for event in reports.events_flat + [e.as_dict() for e in runner._recent]:
            for key in ("grandchild_pid", "escape_pid"):
                if key in event.get("data", {}):
                    found[key] = event["data"][key]
        return found if len(found) == 2 else None

    children = await wait_until(pids, 20)
    agent_pid = runner.agent.pid
    try:
        assert runner.held()
        assert runner.interrupt(reason="user") is True
        assert runner.interrupt(reason="user") is False     # acted on once
        await asyncio.wait_for(task, 30)
        assert not [pid for pid in [agent_pid, *children.values()] if pid_alive(pid)]
        stops = [r.get("stop_state") for r in reports.advances if "status" not in r]
        assert stops == ["signalled", "escalated"]
        final = reports.final
        assert final["status"] == "interrupted" and final["reason"] == "user"
        assert final["stop_state"] == "confirmed" and "wake_error" not in final
        assert "background_processes" not in final
    finally:
        kill_quietly(agent_pid, *children.values())


async def test_interrupt_before_the_agent_started_settles_without_spawning(workdir, environ):
    runner = make_runner(workdir, environ, "@write should-not-exist.txt x")
    runner.interrupt(reason="user")
    await runner.run()
    assert runner.reporter.advances == [{"report_id": runner.reporter.final["report_id"], "status": "interrupted",
                                         "reason": "user", "stop_state": "confirmed"}]
    assert not (workdir / "should-not-exist.txt").exists()


async def test_interrupt_after_exit_is_ignored(workdir, environ):
    runner, reports = await run_turn(workdir, environ, "@reply quick")
    assert runner.interrupt(reason="user") is False
    assert reports.final["status"] == "ended"


class Chatty(Backend):
    """Prints one huge line and many small ones (a CLI echoing a large tool result)."""

    name = "chatty"

    def command(self, *, prompt, cwd, backend_session_id, env):
        code = ("import json; print(json.dumps({'type': 'text', 'text': 'x' * 3_000_000})); "
                "[print(json.dumps({'type': 'progress', 'message': 'm' * 20000})) for _ in range(60)]; "
                "print(json.dumps({'type': 'final', 'text': 'ok'}))")
        import sys

        return LaunchSpec(argv=[sys.executable, "-c", code], env=dict(env))

    def parse_event(self, obj):
        from agents.protocol import AgentEvent

        return [AgentEvent(obj.pop("type"), obj)]


async def test_huge_output_is_cut_and_batched_small(workdir, environ):
    import json

    from agents.runner import BATCH_BYTES_MAX, EVENT_STRING_MAX

    _, reports = await run_turn(workdir, environ, "hi", backend=Chatty())
    batches = [r["events"] for kind, r in reports.items if kind == "events"]
    assert all(len(json.dumps(batch)) <= BATCH_BYTES_MAX + EVENT_STRING_MAX for batch in batches)
    first = reports.events_flat[0]
    assert first["kind"] == "text" and "cut by the daemon: 3000000 characters" in first["data"]["text"]
    assert len(reports.events_flat) == 62 and reports.final["final_reply"] == "ok"


class EnvDump(Backend):
    name = "envdump"

    def command(self, *, prompt, cwd, backend_session_id, env):
        import sys

        code = ("import json, os; print(json.dumps({'type': 'final', 'text': json.dumps({k: os.environ.get(k) for k in "
                "('CHORUS_DAEMON_KEY', 'CHORUS_DAEMON_CONFIG', 'CHORUS_API_URL', 'CHORUS_TASK_TOKEN', 'KEEP')})}))")
        return LaunchSpec(argv=[sys.executable, "-c", code])  # forgets to pass ``env`` on: the daemon does

    def parse_event(self, obj):
        from agents.protocol import AgentEvent

        return [AgentEvent(obj.pop("type"), obj)]


async def test_agent_environment_has_the_task_env_but_never_the_daemon_key(workdir, environ):
    import json

    environ = {**environ, "CHORUS_DAEMON_KEY": "chk_x_secret", "CHORUS_DAEMON_CONFIG": "/etc/chorus.toml", "KEEP": "1"}
    runner = make_runner(workdir, environ, "hi", backend=EnvDump())
    runner.request.env["CHORUS_TASK_TOKEN"] = "task-token"
    await runner.run()
    seen = json.loads(runner.reporter.final["final_reply"])
    # The agent has its task token; the report masks it (a value under a token's name, issue 8):
    # an unset variable would stay null.
    assert seen == {"CHORUS_DAEMON_KEY": None, "CHORUS_DAEMON_CONFIG": None, "KEEP": "1",
                    "CHORUS_API_URL": "http://portal.invalid/api/v1", "CHORUS_TASK_TOKEN": "[REDACTED]"}
