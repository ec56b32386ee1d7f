"""Agent processes (SPEC §5): spawn in a process group of their own, read their output, keep
tails for diagnostics, and stop them verifiably (``agents.proctree``).

``AgentProcess.start`` runs argv with ``start_new_session=True`` (its own session and process
group; pgid == pid), stdin fed from the prompt, stdout read line by line, stdout and stderr tails
kept (≤ 64 KiB together for a wake error). The agent gets the marker variable
``CHORUS_DAEMON_TURN`` that its descendants inherit; a ``TreeTracker`` follows its tree while it
runs, so the stop and the list of leftovers cover every process of the turn and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import subprocess
import time
from collections import deque
from typing import AsyncIterator, Awaitable, Callable

from agents.proctree import (  # noqa: F401 — re-exported: the process layer's vocabulary
    KILL_CONFIRM_S,
    MARKER_ENV,
    ProcRecord,
    StopResult,
    TreeSampler,
    TreeTracker,
    kill_tree,
    process_start_time,
    same_process,
    signal_record,
    stop_tree,
)

log = logging.getLogger("chorus.daemon.process")

MAX_LINE_BYTES = 8 * 1024 * 1024
STDOUT_TAIL_BYTES = 16 * 1024
STDERR_TAIL_BYTES = 64 * 1024
DIAGNOSTICS_BYTES = 64 * 1024


class SpawnError(Exception):
    """The agent could not be started (no such program, not executable, bad cwd, …)."""


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
        return self.tracker.signal_group(sig)

    def escalate_now(self) -> None:
        """Skip the rest of the grace period of a running stop (a second shutdown signal)."""
        self._escalate_now.set()

    async def stop(self, *, timeout_s: float, protocol_stop: Callable[[], bool] | None = None,
                   on_stage: Callable[[str], Awaitable[None]] | None = None,
                   kill_confirm_s: float = KILL_CONFIRM_S) -> StopResult:
        """The verified stop of SPEC §4.1 (one shared deadline = now + timeout_s): see ``stop_tree``."""
        self.stop_requested = True
        return await stop_tree(self.tracker, self.sampler, timeout_s=timeout_s, leader_exited=self.exited,
                               protocol_stop=protocol_stop, on_stage=on_stage, escalate=self._escalate_now,
                               kill_confirm_s=kill_confirm_s)

    async def kill_tree(self, kill_confirm_s: float = KILL_CONFIRM_S) -> StopResult:
        """SIGKILL everything of the turn now and confirm (a daemon error, a forced shutdown)."""
        self.stop_requested = True
        return await kill_tree(self.tracker, self.sampler, leader_exited=self.exited, kill_confirm_s=kill_confirm_s)


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
