"""Process trees of agent turns (SPEC §4.1): who belongs to a turn, and the verified stop.

* ``ProcRecord`` — one process by pid *and* start time; ``same_process`` / ``signal_record`` act
  only while that exact process exists (a pid alone may have been reused by someone else).
* ``TreeTracker`` — every process of one turn seen so far: descendants by parent pid, members of
  the turn's process group (only while the group is provably ours), and, in a deep scan, processes
  carrying the turn's marker variable (``CHORUS_DAEMON_TURN``) in their environment — which finds
  a double-forked orphan whose parent chain is gone.
* ``TreeSampler`` — samples all registered trackers every ~200 ms with one scan of the process
  table in a worker thread, so a child that called ``setsid()`` (left the group) is still known.
* ``stop_tree`` — the verified stop: a gentle first step (protocol stop or SIGINT to the group),
  one deadline, then SIGKILL to the group and to every live record, then confirmation that
  nothing is left. Used for running agents and for orphans a dead daemon left behind.

psutil gives start times and the process table (the daemon also runs on macOS). Zombies count as
gone: they have exited and cannot be signalled; their parent or init reaps them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

import psutil

log = logging.getLogger("chorus.daemon.process")

MARKER_ENV = "CHORUS_DAEMON_TURN"
START_TIME_TOLERANCE_S = 0.005   # psutil answers the same float for one process; clock-tick resolution
SAMPLE_INTERVAL_S = 0.2
STOP_POLL_S = 0.05
KILL_CONFIRM_S = 5.0             # after SIGKILL, how long to wait for the tree to disappear
CREATED_SLACK_S = 1.0            # a process of the turn cannot be older than the spawn (minus clock slack)


@dataclass(frozen=True)
class ProcRecord:
    """One process, identified by pid *and* start time (a pid alone may be reused)."""

    pid: int
    start_time: float
    cmdline: str = ""
    via: str = "root"  # root | child | group | marker

    def as_report(self) -> dict:
        return {"pid": self.pid, "cmdline": self.cmdline}


@dataclass
class StopResult:
    confirmed: bool              # every process of the turn is gone
    escalated: bool              # SIGKILL was needed
    first_step: str              # "protocol" | "sigint" | "none" (already gone)
    survivors: list[ProcRecord] = field(default_factory=list)


# ------------------------------------------------------------------------------------ single processes

def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return shlex.join(psutil.Process(pid).cmdline())[:1000]
    except (psutil.Error, OSError):
        return ""


def same_process(record: ProcRecord, *, zombie_ok: bool = False) -> bool:
    """True while a live (non-zombie, unless ``zombie_ok``) process with this pid and this start
    time exists."""
    try:
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.start_time) > START_TIME_TOLERANCE_S:
            return False
        return zombie_ok or proc.status() != psutil.STATUS_ZOMBIE
    except psutil.ZombieProcess:
        return zombie_ok
    except (psutil.Error, OSError):
        return False


def signal_record(record: ProcRecord, sig: int) -> bool:
    """Send ``sig`` to the process only if it is still the one recorded. True if sent."""
    if not same_process(record):
        return False
    try:
        os.kill(record.pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not allowed to signal pid %s (%s)", record.pid, record.cmdline[:80])
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


# ------------------------------------------------------------------------------------ process table

ProcTable = dict[int, tuple[int, float]]  # pid -> (ppid, start time)


def scan_table() -> ProcTable:
    """One pass over the process table (blocking: run it in a worker thread)."""
    table: ProcTable = {}
    for proc in psutil.process_iter(["ppid", "create_time"]):
        info = proc.info
        if info.get("create_time") is None or info.get("ppid") is None:
            continue
        table[proc.pid] = (info["ppid"], info["create_time"])
    return table


class TreeTracker:
    """Every process of one turn seen so far; grows by ``discover`` + ``merge``."""

    def __init__(self, root: ProcRecord, *, pgid: int, spawned_at: float, marker: str | None = None):
        self.root = root
        self.pgid = pgid
        self.spawned_at = spawned_at
        self.marker = marker
        self.seen: dict[tuple[int, float], ProcRecord] = {(root.pid, root.start_time): root}

    def records(self) -> list[ProcRecord]:
        return list(self.seen.values())

    def discover(self, table: ProcTable, *, deep: bool = False) -> list[ProcRecord]:
        """Processes of this turn in ``table`` not yet known. Safe to run in a worker thread:
        it reads ``seen`` once (a copy) and changes nothing."""
        known = list(self.seen.values())
        alive = [r for r in known if _matches(table, r)]
        found: dict[int, ProcRecord] = {}
        known_pids = {r.pid for r in alive}

        children: dict[int, list[int]] = defaultdict(list)
        for pid, (ppid, _) in table.items():
            children[ppid].append(pid)
        frontier = [r.pid for r in alive]
        while frontier:
            for child in children.get(frontier.pop(), ()):
                if child in known_pids or child in found:
                    continue
                record = self._record(child, table, "child")
                if record is not None:
                    found[child] = record
                    frontier.append(child)

        recent = [pid for pid, (_, created) in table.items()
                  if created >= self.spawned_at - CREATED_SLACK_S and pid not in known_pids and pid not in found]
        # Group members count only while the group is provably ours: a verified member is in it.
        if any(_pgid(r.pid) == self.pgid for r in alive) or any(_pgid(pid) == self.pgid for pid in found):
            for pid in recent:
                if _pgid(pid) == self.pgid and pid not in found:
                    record = self._record(pid, table, "group")
                    if record is not None:
                        found[pid] = record
        if deep and self.marker:
            for pid in recent:
                if pid in found:
                    continue
                try:
                    value = psutil.Process(pid).environ().get(MARKER_ENV)
                except (psutil.Error, OSError):
                    continue
                if value == self.marker:
                    record = self._record(pid, table, "marker")
                    if record is not None:
                        found[pid] = record
        return list(found.values())

    def merge(self, records: Iterable[ProcRecord]) -> None:
        for record in records:
            self.seen.setdefault((record.pid, record.start_time), record)

    def alive(self) -> list[ProcRecord]:
        return [r for r in list(self.seen.values()) if same_process(r)]

    def group_verified(self) -> bool:
        """A recorded process (a zombie too: it still pins the id) is in the group right now, so
        the group id has not been reused by someone else."""
        return any(same_process(r, zombie_ok=True) and _pgid(r.pid) == self.pgid for r in list(self.seen.values()))

    def signal_group(self, sig: int) -> bool:
        """Signal the process group, only while it is verifiably ours."""
        if not self.group_verified():
            return False
        try:
            os.killpg(self.pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def kill_all(self) -> int:
        """SIGKILL the group (if ours) and every live record. Answers how many records were hit."""
        self.signal_group(signal.SIGKILL)
        return sum(signal_record(r, signal.SIGKILL) for r in self.records())

    def _record(self, pid: int, table: ProcTable, via: str) -> ProcRecord | None:
        if pid in (0, 1, os.getpid()):
            return None
        return ProcRecord(pid=pid, start_time=table[pid][1], cmdline=_cmdline(pid), via=via)


def _matches(table: ProcTable, record: ProcRecord) -> bool:
    entry = table.get(record.pid)
    return entry is not None and abs(entry[1] - record.start_time) <= START_TIME_TOLERANCE_S


class TreeSampler:
    """Samples the trees of all registered turns every ``interval`` s with one table scan."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_S):
        self.interval = interval
        self.trackers: set[TreeTracker] = set()
        self._task: asyncio.Task | None = None

    def register(self, tracker: TreeTracker) -> None:
        self.trackers.add(tracker)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="tree-sampler")

    def unregister(self, tracker: TreeTracker) -> None:
        self.trackers.discard(tracker)

    async def sample(self, trackers: Iterable[TreeTracker] | None = None, *, deep: bool = False) -> None:
        trackers = list(self.trackers if trackers is None else trackers)
        if not trackers:
            return

        def work():
            table = scan_table()
            return [(t, t.discover(table, deep=deep)) for t in trackers]

        for tracker, found in await asyncio.to_thread(work):
            tracker.merge(found)

    async def _run(self) -> None:
        while self.trackers:
            try:
                await self.sample()
            except Exception:  # noqa: BLE001 — sampling is best effort; the next round tries again
                log.exception("process tree sampling failed")
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        self.trackers.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


# ------------------------------------------------------------------------------------ activity (stall evidence)

CPU_BUSY_FRACTION = 0.05         # a tree using less than 5 % of one CPU between samples is idle
ACTIVITY_CHILDREN_MAX = 20


def tree_cpu(tracker: TreeTracker) -> tuple[list[ProcRecord], float]:
    """The tree's live processes and the CPU seconds they have used so far (blocking: psutil)."""
    alive = tracker.alive()
    total = 0.0
    for record in alive:
        try:
            times = psutil.Process(record.pid).cpu_times()
            total += times.user + times.system
        except (psutil.Error, OSError):
            continue
    return alive, total


class ActivitySampler:
    """What a turn's process tree is doing while its agent prints nothing (issue 12): ``busy`` (the
    tree uses CPU), ``waiting_on_child`` (idle, a child process alive: a tool that blocks) or
    ``silent`` (idle, no child: the agent itself waits). Compares CPU time with the previous call."""

    def __init__(self, tracker: TreeTracker):
        self.tracker = tracker
        self._previous: tuple[float, float] | None = None  # (monotonic, cpu seconds)

    def sample(self) -> dict:
        alive, cpu = tree_cpu(self.tracker)
        now = time.monotonic()
        fraction = None
        if self._previous is not None and now > self._previous[0]:
            fraction = max(0.0, cpu - self._previous[1]) / (now - self._previous[0])
        self._previous = (now, cpu)
        children = [r for r in alive if r.pid != self.tracker.root.pid]
        if fraction is not None and fraction >= CPU_BUSY_FRACTION:
            state = "busy"
        else:
            state = "waiting_on_child" if children else "silent"
        return {"state": state, "cpu_percent": None if fraction is None else round(100 * fraction, 1),
                "agent_alive": any(r.pid == self.tracker.root.pid for r in alive),
                "children": [r.as_report() for r in children[:ACTIVITY_CHILDREN_MAX]]}


# ------------------------------------------------------------------------------------ the verified stop

async def tree_gone(tracker: TreeTracker, sampler: TreeSampler, leader_exited: Callable[[], bool]) -> bool:
    """The leader has exited and nothing of the tree is alive (confirmed by a deep scan)."""
    if not leader_exited():
        return False
    if await asyncio.to_thread(tracker.alive):
        return False
    await sampler.sample([tracker], deep=True)
    return not await asyncio.to_thread(tracker.alive)


async def stop_tree(tracker: TreeTracker, sampler: TreeSampler, *, timeout_s: float,
                    leader_exited: Callable[[], bool], protocol_stop: Callable[[], bool] | None = None,
                    on_stage: Callable[[str], Awaitable[None]] | None = None,
                    escalate: asyncio.Event | None = None, kill_confirm_s: float = KILL_CONFIRM_S) -> StopResult:
    """The verified stop of SPEC §4.1 with one shared deadline = now + ``timeout_s``.

    ``protocol_stop`` (the backend's own request) is tried first; when it is absent, fails or
    answers False, SIGINT goes to the process group. ``on_stage`` hears "signalled" and, if the
    tree outlives the deadline, "escalated". Setting ``escalate`` ends the grace period early.
    """
    deadline = time.monotonic() + timeout_s
    await sampler.sample([tracker], deep=True)
    if await tree_gone(tracker, sampler, leader_exited):
        return StopResult(confirmed=True, escalated=False, first_step="none")
    first_step = "sigint"
    try:
        if protocol_stop is not None and not leader_exited() and protocol_stop():
            first_step = "protocol"
    except Exception:  # noqa: BLE001 — a failing protocol stop falls back to SIGINT
        log.exception("protocol stop of pid %s failed; sending SIGINT", tracker.root.pid)
    if first_step == "sigint":
        tracker.signal_group(signal.SIGINT)
    if on_stage is not None:
        await on_stage("signalled")
    escalate = escalate or asyncio.Event()
    while time.monotonic() < deadline and not escalate.is_set():
        if await tree_gone(tracker, sampler, leader_exited):
            return StopResult(confirmed=True, escalated=False, first_step=first_step)
        try:
            await asyncio.wait_for(escalate.wait(), min(STOP_POLL_S * 2, max(0.0, deadline - time.monotonic())))
        except asyncio.TimeoutError:
            pass
    if await tree_gone(tracker, sampler, leader_exited):
        return StopResult(confirmed=True, escalated=False, first_step=first_step)
    if on_stage is not None:
        await on_stage("escalated")
    return await kill_tree(tracker, sampler, leader_exited=leader_exited, first_step=first_step,
                           kill_confirm_s=kill_confirm_s)


async def kill_tree(tracker: TreeTracker, sampler: TreeSampler, *, leader_exited: Callable[[], bool],
                    first_step: str = "none", kill_confirm_s: float = KILL_CONFIRM_S) -> StopResult:
    """SIGKILL the group (if ours) and every live record until nothing is left, or give up after
    ``kill_confirm_s`` (a process stuck in the kernel) and name the survivors."""
    give_up = time.monotonic() + kill_confirm_s
    while True:
        await sampler.sample([tracker], deep=True)
        await asyncio.to_thread(tracker.kill_all)
        await asyncio.sleep(STOP_POLL_S)
        if await tree_gone(tracker, sampler, leader_exited):
            return StopResult(confirmed=True, escalated=True, first_step=first_step)
        if time.monotonic() >= give_up:
            survivors = await asyncio.to_thread(tracker.alive)
            log.error("pid %s: %d process(es) survived SIGKILL: %s", tracker.root.pid, len(survivors),
                      [(r.pid, r.cmdline[:60]) for r in survivors])
            return StopResult(confirmed=False, escalated=True, first_step=first_step, survivors=survivors)
