"""The daemon's process sampling for stall evidence (issue 12 item 1), with real processes: an agent
that waits on a child is told from one that is silent on its own and from one that computes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from agents.proctree import ActivitySampler, ProcRecord, TreeSampler, TreeTracker, process_start_time

from .helpers import wait_until

PY = sys.executable
AGENTS = {
    "silent": "import time; time.sleep(60)",
    "waiting_on_child": "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                        "'import time; time.sleep(60)', '--marker-arg'])",
    "busy": "while True: pass",
}


@pytest.mark.parametrize("expected", sorted(AGENTS))
async def test_the_sample_tells_waiting_on_a_child_from_silent_and_busy(expected):
    process = subprocess.Popen([PY, "-c", AGENTS[expected]], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        record = ProcRecord(pid=process.pid, start_time=process_start_time(process.pid), cmdline="agent")
        tracker = TreeTracker(record, pgid=process.pid, spawned_at=record.start_time)
        table_sampler = TreeSampler()
        activity = ActivitySampler(tracker)

        async def sample_is():
            await table_sampler.sample([tracker])  # as the daemon's sampler does every 200 ms
            await asyncio.sleep(0.3)  # CPU is compared between two samples
            sample = activity.sample()
            return sample if sample["state"] == expected else None

        sample = await wait_until(sample_is, timeout=20, message=f"a {expected} sample")
        assert sample["agent_alive"] is True
        if expected == "waiting_on_child":
            assert "--marker-arg" in sample["children"][0]["cmdline"]
        else:
            assert sample["children"] == []
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
