"""Agent processes (SPEC §4.1, §5): spawn in a process group of their own, follow the whole tree,
stop it verifiably, and say what is left behind.

* ``AgentProcess.start`` runs argv with ``start_new_session=True`` (its own session and process
  group; pgid == pid), stdin fed from the prompt, stdout read line by line, stdout and stderr
  tails kept for diagnostics. The agent also gets a marker variable in its environment
  (``CHORUS_DAEMON_TURN``) that its descendants inherit.
* ``TreeTracker`` remembers every process of the turn seen while it ran — descendants by parent
  pid, members of the process group, and (in a deep scan) processes carrying the marker — each
  as a ``ProcRecord`` (pid *and* start time). ``TreeSampler`` samples all running turns every
  ~200 ms in one scan of the process table (in a worker thread), so a child that called
  ``setsid()`` and left the group, or whose parent died, is still known.
* Nothing is signalled unless it is verified first: a record is signalled only while a process
  with that pid *and* that start time exists (``signal_record``); the group is signalled only
  while a verified record is still in it, because a process group id can be reused once the
  group is empty. The daemon never kills a process it did not start.
* ``AgentProcess.stop`` is the verified stop: protocol stop or SIGINT to the group, one deadline,
  then SIGKILL to the group and to every live record, then confirmation that all are gone.

psutil is used for start times and the process table (the daemon also runs on macOS). Zombies
count as gone: they have exited and cannot be signalled; their parent or init reaps them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import subprocess
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterable

import psutil

log = logging.getLogger("chorus.daemon.process")

MARKER_ENV = "CHORUS_DAEMON_TURN"
START_TIME_TOLERANCE_S = 0.005   # psutil answers the same float for one process; clock-tick resolution
SAMPLE_INTERVAL_S = 0.2
STOP_POLL_S = 0.05
KILL_CONFIRM_S = 5.0             # after SIGKILL, how long to wait for the tree to disappear
MAX_LINE_BYTES = 8 * 1024 * 1024
STDOUT_TAIL_BYTES = 16 * 1024
STDERR_TAIL_BYTES = 64 * 1024
DIAGNOSTICS_BYTES = 64 * 1024
CREATED_SLACK_S = 1.0            # a process of the turn cannot be older than the spawn (minus clock slack)


class SpawnError(Exception):
    """The agent could not be started (no such program, not executable, bad cwd, …)."""


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


# ------------------------------------------------------------------------------------ output tails

class Tail:
    """The last ``limit`` bytes written to it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.chunks: deque[bytes] = deque()
        self.size = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.chunks.append(data)
        self.size += len(data)
        while self.size - len(self.chunks[0]) >= self.limit:
            self.size -= len(self.chunks.popleft())

    def text(self, limit: int | None = None) -> str:
        data = b"".join(self.chunks)[-(limit or self.limit):]
        return data.decode("utf-8", "replace")


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Tells when the process has exited — ``Process.wait()`` also waits for the pipes to close,
    which never happens while a leftover grandchild holds them."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop):
        super().__init__(limit=limit, loop=loop)
        self.exited = loop.create_future()

    def process_exited(self):
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


# ------------------------------------------------------------------------------------ the agent process

class AgentProcess:
    def __init__(self, process: asyncio.subprocess.Process, protocol: _Protocol, transport, *,
                 record: ProcRecord, spawned_at: float, marker: str, sampler: TreeSampler, own_sampler: bool):
        self.process = process
        self.protocol = protocol
        self.transport = transport
        self.record = record
        self.pid = record.pid
        self.pgid = record.pid
        self.spawned_at = spawned_at
        self.tracker = TreeTracker(record, pgid=self.pgid, spawned_at=spawned_at, marker=marker)
        self.sampler = sampler
        self._own_sampler = own_sampler
        self.stdout_tail = Tail(STDOUT_TAIL_BYTES)
        self.stderr_tail = Tail(STDERR_TAIL_BYTES)
        self._stderr_task: asyncio.Task | None = None
        self._stdin_task: asyncio.Task | None = None
        self._escalate_now = asyncio.Event()
        self.stop_requested = False

    @classmethod
    async def start(cls, argv: list[str], *, cwd: str, env: dict[str, str], stdin_text: str | None,
                    marker: str, sampler: TreeSampler | None = None) -> AgentProcess:
        """Spawn ``argv`` in a new session (own process group). SpawnError if it cannot run."""
        if not argv:
            raise SpawnError("empty command line")
        loop = asyncio.get_running_loop()
        spawned_at = time.time()
        env = {**env, MARKER_ENV: marker}
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _Protocol(MAX_LINE_BYTES, loop), *argv, cwd=cwd, env=env,
                stdin=asyncio.subprocess.PIPE if stdin_text is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, close_fds=True)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            raise SpawnError(_spawn_message(argv, cwd, exc)) from exc
        process = asyncio.subprocess.Process(transport, protocol, loop)
        start_time = process_start_time(process.pid)
        record = ProcRecord(pid=process.pid, start_time=start_time if start_time is not None else -1.0,
                            cmdline=shlex.join(argv)[:1000], via="root")
        own = sampler is None
        agent = cls(process, protocol, transport, record=record, spawned_at=spawned_at, marker=marker,
                    sampler=sampler or TreeSampler(), own_sampler=own)
        agent.sampler.register(agent.tracker)
        agent._stderr_task = loop.create_task(agent._read_stderr(), name=f"stderr-{process.pid}")
        if stdin_text is not None:
            agent._stdin_task = loop.create_task(agent._feed_stdin(stdin_text), name=f"stdin-{process.pid}")
        return agent

    # -- i/o
    async def _feed_stdin(self, text: str) -> None:
        stdin = self.process.stdin
        try:
            stdin.write(text.encode("utf-8"))
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent stopped reading (or exited): its exit status tells the story
        finally:
            try:
                stdin.close()
            except Exception:  # noqa: BLE001
                pass

    async def _read_stderr(self) -> None:
        reader = self.process.stderr
        while chunk := await reader.read(65536):
            self.stderr_tail.write(chunk)

    async def lines(self) -> AsyncIterator[str]:
        """stdout, line by line (decoded, without the newline). A line longer than
        MAX_LINE_BYTES is cut there; the rest of it is skipped."""
        reader = self.process.stdout
        buffer = bytearray()
        skipping = False
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            self.stdout_tail.write(chunk)
            start = 0
            while (end := chunk.find(b"\n", start)) != -1:
                if not skipping:
                    buffer += chunk[start:end]
                    yield bytes(buffer[:MAX_LINE_BYTES]).decode("utf-8", "replace").rstrip("\r")
                buffer.clear()
                skipping = False
                start = end + 1
            if not skipping:
                buffer += chunk[start:]
                if len(buffer) > MAX_LINE_BYTES:
                    yield bytes(buffer[:MAX_LINE_BYTES]).decode("utf-8", "replace")
                    buffer.clear()
                    skipping = True
        if buffer and not skipping:
            yield buffer.decode("utf-8", "replace").rstrip("\r")

    def diagnostics(self) -> str:
        """stderr then stdout tails, at most 64 KiB together."""
        out = self.stdout_tail.text().strip()
        err_room = DIAGNOSTICS_BYTES - min(len(out.encode()), STDOUT_TAIL_BYTES) - 40
        err = self.stderr_tail.text(err_room).strip()
        parts = []
        if err:
            parts.append(err)
        if out:
            parts.append("--- stdout (tail) ---\n" + out if err else out)
        text = "\n".join(parts)
        return text.encode()[-DIAGNOSTICS_BYTES:].decode("utf-8", "ignore")

    # -- lifecycle
    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def exited(self) -> bool:
        return self.protocol.exited.done() or self.process.returncode is not None

    async def wait_exit(self) -> int:
        """The exit status (negative: killed by that signal) as soon as the process exits,
        whether or not leftover processes still hold its pipes."""
        await asyncio.shield(self.protocol.exited)
        while self.process.returncode is None:  # set in the same callback; belt and braces
            await asyncio.sleep(0.01)
        return self.process.returncode

    async def finish_io(self, grace_s: float = 1.0) -> None:
        """After exit: let stderr drain for ``grace_s``, then close our ends of the pipes."""
        tasks = [t for t in (self._stderr_task, self._stdin_task) if t is not None]
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        self.sampler.unregister(self.tracker)
        try:
            self.transport.close()
        except Exception:  # noqa: BLE001
            pass
        if self._own_sampler:
            asyncio.get_running_loop().create_task(self.sampler.close())

    # -- the tree
    async def sample(self, *, deep: bool = False) -> None:
        await self.sampler.sample([self.tracker], deep=deep)

    async def alive_tree(self) -> list[ProcRecord]:
        """Every live process of the turn (deep scan first: nothing unseen is left out)."""
        await self.sample(deep=True)
        return await asyncio.to_thread(self.tracker.alive)

    async def leftovers(self) -> list[ProcRecord]:
        """After the agent exited: what of its tree still runs (reported, never killed)."""
        return [r for r in await self.alive_tree() if r.pid != self.pid]

    def signal_group(self, sig: int) -> bool:
        """Signal the process group if it is verifiably ours."""
        if not self.tracker.group_verified():
            return False
        try:
            os.killpg(self.pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def kill_all(self) -> int:
        """SIGKILL the group (if ours) and every live record. Answers how many records were hit."""
        self.signal_group(signal.SIGKILL)
        return sum(signal_record(r, signal.SIGKILL) for r in self.tracker.records())

    def escalate_now(self) -> None:
        """Skip the rest of the grace period of a running stop (a second shutdown signal)."""
        self._escalate_now.set()

    async def stop(self, *, timeout_s: float, protocol_stop: Callable[[], bool] | None = None,
                   on_stage: Callable[[str], Awaitable[None]] | None = None,
                   kill_confirm_s: float = KILL_CONFIRM_S) -> StopResult:
        """The verified stop of SPEC §4.1 (one shared deadline = now + timeout_s)."""
        self.stop_requested = True
        deadline = time.monotonic() + timeout_s
        await self.sample(deep=True)
        if await self._gone():
            return StopResult(confirmed=True, escalated=False, first_step="none")
        first_step = "sigint"
        try:
            if protocol_stop is not None and not self.exited() and protocol_stop():
                first_step = "protocol"
        except Exception:  # noqa: BLE001 — a failing protocol stop falls back to SIGINT
            log.exception("protocol stop of pid %s failed; sending SIGINT", self.pid)
        if first_step == "sigint":
            self.signal_group(signal.SIGINT)
        if on_stage is not None:
            await on_stage("signalled")
        while time.monotonic() < deadline and not self._escalate_now.is_set():
            if await self._gone():
                return StopResult(confirmed=True, escalated=False, first_step=first_step)
            await self._sleep_or_escalate(min(STOP_POLL_S * 2, max(0.0, deadline - time.monotonic())))
        if await self._gone():
            return StopResult(confirmed=True, escalated=False, first_step=first_step)
        if on_stage is not None:
            await on_stage("escalated")
        return await self._kill_and_confirm(first_step, kill_confirm_s)

    async def kill_tree(self, kill_confirm_s: float = KILL_CONFIRM_S) -> StopResult:
        """SIGKILL everything of the turn now and confirm (timeouts, a forced shutdown)."""
        self.stop_requested = True
        await self.sample(deep=True)
        return await self._kill_and_confirm("none", kill_confirm_s)

    async def _kill_and_confirm(self, first_step: str, kill_confirm_s: float) -> StopResult:
        give_up = time.monotonic() + kill_confirm_s
        while True:
            await self.sample(deep=True)
            await asyncio.to_thread(self.kill_all)
            await asyncio.sleep(STOP_POLL_S)
            if await self._gone():
                return StopResult(confirmed=True, escalated=True, first_step=first_step)
            if time.monotonic() >= give_up:
                survivors = await asyncio.to_thread(self.tracker.alive)
                log.error("pid %s: %d process(es) survived SIGKILL: %s", self.pid, len(survivors),
                          [(r.pid, r.cmdline[:60]) for r in survivors])
                return StopResult(confirmed=False, escalated=True, first_step=first_step, survivors=survivors)

    async def _gone(self) -> bool:
        """The agent has exited and nothing of its tree is alive (verified with a deep scan)."""
        if not self.exited():
            return False
        if await asyncio.to_thread(self.tracker.alive):
            return False
        await self.sample(deep=True)
        return not await asyncio.to_thread(self.tracker.alive)

    async def _sleep_or_escalate(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._escalate_now.wait(), seconds)
        except asyncio.TimeoutError:
            pass


def _spawn_message(argv: list[str], cwd: str, exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        if not os.path.isdir(cwd):
            return f"working directory {cwd} does not exist"
        return f"{argv[0]}: command not found"
    if isinstance(exc, PermissionError):
        return f"{argv[0]}: permission denied ({exc.strerror or exc})"
    if isinstance(exc, OSError):
        return f"{argv[0]}: cannot be started ({exc.strerror or exc})"
    return f"{argv[0]}: cannot be started ({exc})"
