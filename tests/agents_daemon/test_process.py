"""The process layer with real child processes: own group, output, tails, tree tracking, the
verified stop (SPEC §4.1) and the pid + start time check."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from agents.process import (
    DIAGNOSTICS_BYTES,
    AgentProcess,
    ProcRecord,
    SpawnError,
    TreeSampler,
    TreeTracker,
    process_start_time,
    same_process,
    signal_record,
)

from .helpers import kill_quietly, pid_alive, wait_until

PY = sys.executable
IGNORE_STOP = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)"

# An agent that ignores SIGINT/SIGTERM, with a grandchild in its group (also deaf to both) and a
# child that left the group with setsid(); it prints their pids, then works "forever".
STUBBORN_AGENT = f"""
import json, subprocess, sys, time
{IGNORE_STOP}
quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
grandchild = subprocess.Popen([sys.executable, "-c", "{IGNORE_STOP}; import time; time.sleep(120)"], **quiet)
escaped = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); {IGNORE_STOP}; time.sleep(120)"], **quiet)
print(json.dumps({{"grandchild": grandchild.pid, "escaped": escaped.pid}}), flush=True)
time.sleep(120)
"""


async def start(code: str, *, stdin_text: str | None = None, cwd: str | None = None, marker: str = "test-turn",
                sampler: TreeSampler | None = None) -> AgentProcess:
    return await AgentProcess.start([PY, "-c", code], cwd=cwd or os.getcwd(), env=dict(os.environ),
                                    stdin_text=stdin_text, marker=marker, sampler=sampler)


async def first_line(agent: AgentProcess) -> str:
    async for line in agent.lines():
        return line
    raise AssertionError("no output")


async def collect(agent: AgentProcess) -> list[str]:
    return [line async for line in agent.lines()]


async def test_spawn_in_own_group_with_stdin_and_env():
    code = ("import os, sys, json; data = sys.stdin.read(); "
            "print(json.dumps({'pgid': os.getpgid(0), 'sid': os.getsid(0), 'stdin': data, "
            "'marker': os.environ.get('CHORUS_DAEMON_TURN')}))")
    agent = await start(code, stdin_text="the prompt\nline two", marker="turn-42")
    lines = await collect(agent)
    assert await agent.wait_exit() == 0
    info = json.loads(lines[0])
    assert info["pgid"] == agent.pid == agent.pgid and info["sid"] == agent.pid
    assert info["pgid"] != os.getpgid(0)
    assert info["stdin"] == "the prompt\nline two"
    assert info["marker"] == "turn-42"
    assert agent.record.start_time == pytest.approx(agent.spawned_at, abs=2)
    agent.close()


async def test_lines_split_partial_and_overlong(monkeypatch):
    import agents.process as proc_module

    monkeypatch.setattr(proc_module, "MAX_LINE_BYTES", 1000)
    code = ("import sys; w = sys.stdout.write; w('one\\r\\ntwo\\n'); sys.stdout.flush(); "
            "w('x' * 5000 + '\\n'); w('after\\n'); w('no newline at end')")
    agent = await start(code)
    lines = await collect(agent)
    await agent.wait_exit()
    assert lines[:2] == ["one", "two"]
    assert lines[2] == "x" * 1000          # cut at the limit, the rest of that line skipped
    assert lines[3:] == ["after", "no newline at end"]
    agent.close()


async def test_exit_status_and_diagnostics_tail():
    code = ("import sys; print('some output', flush=True); "
            "[sys.stderr.write(f'error line {i:06d} ' + 'e' * 100 + '\\n') for i in range(2000)]; sys.exit(3)")
    agent = await start(code)
    lines = await collect(agent)
    assert await agent.wait_exit() == 3
    await agent.finish_io()
    details = agent.diagnostics()
    assert len(details.encode()) <= DIAGNOSTICS_BYTES
    assert "error line 001999" in details and "error line 000000" not in details
    assert "some output" in details and lines == ["some output"]
    agent.close()


async def test_killed_by_signal_is_a_negative_status():
    agent = await start("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert await agent.wait_exit() == -signal.SIGSEGV
    agent.close()


@pytest.mark.parametrize("argv, message", [
    (["/nonexistent/agent-cli"], "command not found"),
    ([], "empty command line"),
])
async def test_spawn_failures(argv, message, tmp_path):
    with pytest.raises(SpawnError, match=message):
        await AgentProcess.start(argv, cwd=str(tmp_path), env=dict(os.environ), stdin_text=None, marker="m")


async def test_spawn_failure_not_executable_and_missing_cwd(tmp_path):
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    with pytest.raises(SpawnError, match="permission denied"):
        await AgentProcess.start([str(script)], cwd=str(tmp_path), env=dict(os.environ), stdin_text=None, marker="m")
    with pytest.raises(SpawnError, match="does not exist"):
        await AgentProcess.start([PY, "-c", "pass"], cwd=str(tmp_path / "gone"), env=dict(os.environ),
                                 stdin_text=None, marker="m")


async def test_exit_is_seen_while_a_leftover_holds_stdout_open():
    # The child inherits stdout and outlives the agent: the agent's exit must still be seen at once.
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "start_new_session=True); print(p.pid, flush=True)")
    agent = await start(code)
    leftover = int(await first_line(agent))
    try:
        assert await asyncio.wait_for(agent.wait_exit(), 10) == 0
        left = await agent.leftovers()
        assert [r.pid for r in left] == [leftover]
        assert "time.sleep(60)" in left[0].cmdline
        await agent.finish_io(grace_s=0.1)
    finally:
        kill_quietly(leftover)
        agent.close()


async def test_verified_stop_kills_group_grandchild_and_escaped_child():
    sampler = TreeSampler()
    agent = await start(STUBBORN_AGENT, sampler=sampler)
    pids = json.loads(await first_line(agent))
    everyone = [agent.pid, pids["grandchild"], pids["escaped"]]
    try:
        # the escaped child really left the group
        await wait_until(lambda: os.getpgid(pids["escaped"]) == pids["escaped"])
        assert os.getpgid(pids["grandchild"]) == agent.pgid
        stages = []

        async def on_stage(stage):
            stages.append((stage, time.monotonic()))

        timeout = 1.0
        started = time.monotonic()
        result = await agent.stop(timeout_s=timeout, on_stage=on_stage)
        elapsed = time.monotonic() - started
        assert result.confirmed and result.escalated and result.first_step == "sigint"
        assert [s for s, _ in stages] == ["signalled", "escalated"]
        assert stages[1][1] - started >= timeout * 0.95   # the deadline was honoured before SIGKILL
        assert elapsed <= timeout + 1.0
        assert not [pid for pid in everyone if pid_alive(pid)]
        assert await agent.wait_exit() == -signal.SIGKILL
        vias = {r.pid: r.via for r in agent.tracker.records()}
        assert vias[pids["grandchild"]] in ("child", "group") and pids["escaped"] in vias
    finally:
        kill_quietly(*everyone)
        agent.close()
        await sampler.close()


async def test_stop_of_a_cooperative_agent_needs_no_kill():
    agent = await start("import time, sys; print('ready', flush=True); time.sleep(60)")
    assert await first_line(agent) == "ready"
    result = await agent.stop(timeout_s=5)
    assert result.confirmed and not result.escalated
    assert await agent.wait_exit() in (-signal.SIGINT, 1)  # KeyboardInterrupt
    agent.close()


async def test_protocol_stop_is_tried_first():
    agent = await start(f"{IGNORE_STOP}\nimport sys, time\nprint('ready', flush=True)\n"
                        "while True:\n    line = sys.stdin.readline()\n    if line.strip() == 'stop': break\n"
                        "    time.sleep(0.01)\n", stdin_text="")
    assert await first_line(agent) == "ready"
    asked = []

    def protocol_stop():
        asked.append(True)
        os.kill(agent.pid, signal.SIGTERM)  # ignored: the escalation must follow
        return True

    result = await agent.stop(timeout_s=0.3, protocol_stop=protocol_stop)
    assert asked == [True] and result.first_step == "protocol" and result.escalated and result.confirmed
    agent.close()


async def test_escaped_child_is_found_by_sampling_even_without_the_marker():
    """A child that called setsid() is found by its parent pid while the agent runs, and stays
    known (pid + start time) after the agent exits and it is re-parented."""
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import os, time; os.setsid(); time.sleep(60)']); print(p.pid, flush=True); sys.stdin.readline()")
    proc = subprocess.Popen([PY, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                            text=True)
    escaped = int(proc.stdout.readline())
    sampler = TreeSampler()
    try:
        root = ProcRecord(proc.pid, process_start_time(proc.pid))
        tracker = TreeTracker(root, pgid=proc.pid, spawned_at=time.time() - 5, marker=None)

        async def found():
            await sampler.sample([tracker])
            return escaped in {r.pid for r in tracker.records()}

        await wait_until(found)
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait(10)
        await wait_until(lambda: psutil.Process(escaped).ppid() != proc.pid)
        assert [r.pid for r in tracker.alive()] == [escaped]
    finally:
        kill_quietly(escaped, proc.pid)
        await sampler.close()


async def test_orphan_of_a_double_fork_is_found_by_the_marker():
    # The intermediate exits at once, so the orphan's parent is init before any sample can see it.
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "\"import subprocess, sys; q = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "start_new_session=True); print(q.pid, flush=True)\"], stdout=subprocess.PIPE, text=True); "
            "print(p.stdout.readline().strip(), flush=True); p.wait()")
    agent = await start(code, marker="double-fork-turn")
    orphan = int(await first_line(agent))
    try:
        await agent.wait_exit()
        left = await agent.leftovers()
        assert orphan in [r.pid for r in left]
        result = await agent.stop(timeout_s=0.5)
        assert result.confirmed and not pid_alive(orphan)
    finally:
        kill_quietly(orphan)
        agent.close()


async def test_a_reused_pid_is_never_signalled():
    """A record whose start time does not match the live process with that pid is someone else."""
    stranger = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        real = ProcRecord(stranger.pid, process_start_time(stranger.pid))
        reused = ProcRecord(stranger.pid, real.start_time - 3600, cmdline="an agent that exited long ago")
        assert same_process(real) and not same_process(reused)
        assert signal_record(reused, signal.SIGKILL) is False
        assert stranger.poll() is None

        # the same through a whole verified stop: a stale record in the tracker is left alone
        agent = await start("import time; time.sleep(60)")
        agent.tracker.merge([reused])
        result = await agent.stop(timeout_s=0.2)
        assert result.confirmed
        assert stranger.poll() is None and pid_alive(stranger.pid)

        assert signal_record(real, signal.SIGKILL) is True
        assert stranger.wait(10) == -signal.SIGKILL
        agent.close()
    finally:
        kill_quietly(stranger.pid)
        stranger.wait(10)


async def test_group_is_not_signalled_once_nothing_of_ours_is_in_it():
    agent = await start("pass")
    await agent.wait_exit()
    await wait_until(lambda: not pid_alive(agent.pid))
    assert agent.tracker.group_verified() is False
    assert agent.signal_group(signal.SIGKILL) is False
    agent.close()
