"""Turns a killed daemon left running: stopped (verified) and reported at the next start."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from agents.orphans import RunningRegistry, recover_orphans
from agents.proctree import TreeSampler, process_start_time

from .helpers import ListReporter, kill_quietly, pid_alive, wait_until

PY = sys.executable
DEAF = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)"
ORPHAN_AGENT = f"""
import json, subprocess, sys, time
{DEAF}
quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
g = subprocess.Popen([sys.executable, "-c", "{DEAF}; import time; time.sleep(120)"], **quiet)
e = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); {DEAF}; time.sleep(120)"], **quiet)
print(json.dumps([g.pid, e.pid]), flush=True)
time.sleep(120)
"""


def spawn_orphan(turn: str, cwd) -> tuple[subprocess.Popen, list[int], dict]:
    """What a killed daemon leaves: an agent tree in its own session, carrying the turn's marker."""
    spawned_at = time.time()
    proc = subprocess.Popen([PY, "-c", ORPHAN_AGENT], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "CHORUS_DAEMON_TURN": turn}, cwd=str(cwd))
    children = json.loads(proc.stdout.readline())
    record = {"turn": turn, "session": "s", "pid": proc.pid, "pgid": proc.pid,
              "start_time": process_start_time(proc.pid), "spawned_at": spawned_at, "marker": turn,
              "cwd": str(cwd), "cmdline": "agent"}
    return proc, children, record


def test_registry_round_trip(tmp_path):
    registry = RunningRegistry(str(tmp_path / "running"))
    registry.add({"turn": "t/1", "pid": 10, "start_time": 1.5})
    registry.add({"turn": "t2", "pid": 11, "start_time": 2.5})
    (tmp_path / "running" / "broken.json").write_text("{")
    (tmp_path / "running" / "half.json.tmp").write_text("{")
    assert sorted(r["turn"] for r in registry.load()) == ["t/1", "t2"]
    assert sorted(os.listdir(tmp_path / "running")) == ["t2.json", "t_1.json"]
    registry.remove("t/1")
    registry.remove("t/1")
    assert [r["turn"] for r in registry.load()] == ["t2"]


async def test_an_orphaned_tree_is_stopped_and_reported(tmp_path):
    registry = RunningRegistry(str(tmp_path / "running"))
    proc, children, record = spawn_orphan("turn-orphan", tmp_path)
    proc.stdout.close()  # the daemon that read it is gone
    registry.add(record)
    (tmp_path / "written-by-the-agent.txt").write_text("x")
    reporter, sampler = ListReporter(), TreeSampler()
    try:
        recovered = await recover_orphans(registry.load(), registry, reporter=reporter, sampler=sampler,
                                          sigint_timeout_s=0.5)
        assert recovered == ["turn-orphan"]
        assert proc.wait(5) is not None
        assert not [pid for pid in [proc.pid, *children] if pid_alive(pid)]
        report = reporter.final
        assert (report["status"], report["reason"], report["stop_state"]) == ("interrupted", "shutdown", "confirmed")
        assert "written-by-the-agent.txt" in report["changes"]["files"]
        assert registry.load() == []
    finally:
        kill_quietly(proc.pid, *children)
        await sampler.close()


async def test_a_record_whose_pid_was_reused_touches_nothing(tmp_path):
    stranger = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    registry = RunningRegistry(str(tmp_path / "running"))
    registry.add({"turn": "turn-old", "pid": stranger.pid, "pgid": stranger.pid,
                  "start_time": process_start_time(stranger.pid) - 3600, "spawned_at": time.time() - 3600,
                  "marker": "turn-old"})
    reporter, sampler = ListReporter(), TreeSampler()
    try:
        await recover_orphans(registry.load(), registry, reporter=reporter, sampler=sampler, sigint_timeout_s=0.2)
        assert stranger.poll() is None and pid_alive(stranger.pid)
        assert reporter.final["reason"] == "shutdown" and reporter.final["stop_state"] == "confirmed"
    finally:
        kill_quietly(stranger.pid)
        stranger.wait(5)
        await sampler.close()


async def test_the_daemon_recovers_orphans_at_start(tmp_path, monkeypatch):
    from agents.daemon import Daemon
    from agents.daemon_config import build_config

    spool_dir = tmp_path / "spool"
    proc, children, record = spawn_orphan("turn-left", tmp_path)
    RunningRegistry(str(spool_dir / "running")).add(record)
    reports = []

    async def post(path, body):
        reports.append((path, body))
        return 200, "{}"

    def no_portal(url, headers):
        raise ConnectionRefusedError("no portal in this test")

    config = build_config({"portal": "http://127.0.0.1:9", "key": "k", "cwds": [str(tmp_path)],
                           "sigint_timeout_s": 0.5, "spool_dir": str(spool_dir)}, {}, {})
    daemon = Daemon(config, poster=post, connect=no_portal, install_signals=False)
    task = asyncio.create_task(daemon.run())
    try:
        await wait_until(lambda: reports, 15)
        assert reports[0][0] == "/daemon/turns/turn-left/advance"
        assert reports[0][1]["reason"] == "shutdown"
        assert not [pid for pid in [proc.pid, *children] if pid_alive(pid)]
        assert not os.listdir(spool_dir / "running")
    finally:
        daemon.request_shutdown()
        await asyncio.wait_for(task, 15)
        kill_quietly(proc.pid, *children)
