"""One turn on this machine, from the start command to the last report (SPEC §3.1, §4.1, §5).

``TurnRunner.run`` checks the cwd, builds the backend's command line, spawns the agent
(``agents.process``), reports ``running`` with the pid, turns stdout lines into events (batched
every 200 ms or 100 events), and at exit reports how the turn ended: ``ended`` (exit 0), or
``requires_action`` (exit 0 after the agent asked for an answer), or ``interrupted`` with reason
``crash`` (a wake error: ``exited_nonzero``, ``signal``, ``spawn_failed``, ``auth``) — always with
the changes in the cwd and the processes the agent left running (SPEC §1 rules 1 and 2).

``interrupt`` is the verified stop of §4.1 (stop-state progress reported for an operator's stop);
a turn's time limit (payload ``timeout_s``, else the backend's ``default_timeout_s``) and a daemon
shutdown stop it the same way, reported as ``timeout`` / ``shutdown``.

Reports go through a ``Reporter`` (the daemon's spool); this module knows nothing of HTTP.  Each
report is redacted first (agents.redaction_rules, the portal's rules): the spool never keeps a
secret on disk, also while the portal is down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from agents import protocol as p
from agents.changes import collect_changes
from agents.process import AgentProcess, SpawnError, StopResult, TreeSampler
from agents.proctree import ActivitySampler
from agents.redaction_rules import StreamRedactor, ingest

log = logging.getLogger("chorus.daemon.turn")

EVENT_BATCH_MAX = 100
EVENT_FLUSH_S = 0.2
REQUIRES_ACTION_GRACE_S = 1.0   # an agent that exits right after asking reports it once, at exit
STDOUT_DRAIN_S = 2.0            # after exit, how long leftovers may keep our stdout pipe open
FINISH_EVENTS_KEEP = 5000       # events kept for the backend's ``finish`` (final reply derivation)
SUMMARY_MAX = 300
EVENT_STRING_MAX = 32 * 1024    # characters per string in one event (a huge tool result is cut)
BATCH_BYTES_MAX = 512 * 1024    # a batch is sent before it grows past this (the portal caps request bodies)
USAGE_KEYS = ("input", "output", "cache_read", "cache_write")
# The daemon's own secrets never reach an agent (it may print its environment into a transcript).
SCRUBBED_ENV = frozenset({"CHORUS_DAEMON_KEY", "CHORUS_DAEMON_CONFIG"})


class Reporter(Protocol):
    def advance(self, turn: str, report: dict) -> None: ...
    def events(self, turn: str, events: list[dict]) -> None: ...


@dataclass
class TurnRequest:
    """A start_turn / resume command's payload, checked."""

    turn: str
    session: str
    cwd: str
    prompt: str
    backend: str | None = None
    backend_session_id: str | None = None
    trigger: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    command_id: str | None = None
    # Tools the operator allowed when answering a permission denial (sessions_app.actions):
    # this turn only, for adapters that take them (claude_code).
    allow_tools: list[str] = field(default_factory=list)

    @classmethod
    def from_command(cls, command: dict) -> TurnRequest:
        payload = command.get("payload") if isinstance(command.get("payload"), dict) else {}
        turn = command.get("turn")
        if not isinstance(turn, str) or not turn:
            raise ValueError("a start command names its turn")
        env = payload.get("env") if isinstance(payload.get("env"), dict) else {}
        timeout = payload.get("timeout_s")
        try:
            timeout = float(timeout) if timeout not in (None, "") else None
        except (TypeError, ValueError):
            timeout = None
        return cls(turn=turn, session=str(payload.get("session") or ""), cwd=str(payload.get("cwd") or ""),
                   prompt=str(payload.get("prompt") or ""), backend=payload.get("backend") or None,
                   backend_session_id=payload.get("backend_session_id") or None, trigger=payload.get("trigger"),
                   env={str(k): str(v) for k, v in env.items() if v is not None},
                   timeout_s=timeout if timeout and timeout > 0 else None, command_id=command.get("id"),
                   allow_tools=[str(t) for t in payload.get("allow_tools") or [] if isinstance(t, str) and t][:20]
                   if isinstance(payload.get("allow_tools"), list) else [])


def cwd_problem(cwd: str, allowed: tuple[str, ...] | list[str]) -> str | None:
    """Why the agent may not run in ``cwd`` (None: it may). Symlinks are resolved first."""
    if not cwd or not os.path.isabs(cwd):
        return f"the working directory {cwd!r} is not an absolute path"
    real = os.path.realpath(cwd)
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in allowed):
        return f"the working directory {cwd} is outside this daemon's directories ({', '.join(allowed)})"
    if not os.path.isdir(real):
        return f"the working directory {cwd} does not exist on this machine"
    return None


class TurnSummary:
    """What the events of a turn amount to, kept up to date as they are parsed."""

    def __init__(self):
        self.backend_session_id: str | None = None
        self.final_reply: str | None = None
        self.last_text: str | None = None
        self.usage = dict.fromkeys(USAGE_KEYS, 0)
        self.usage_seen = False
        self.requires_action: dict | None = None
        self.outcome: dict | None = None
        self.auth_error: str | None = None
        self.fatal_error: dict | None = None
        self.count = 0

    def add(self, event: p.AgentEvent) -> None:
        self.count += 1
        data = event.data if isinstance(event.data, dict) else {}
        if event.kind == p.EV_SESSION and data.get("id"):
            self.backend_session_id = str(data["id"])
        elif event.kind == p.EV_FINAL:
            self.final_reply = None if data.get("text") is None else str(data["text"])
        elif event.kind == p.EV_TEXT and str(data.get("text", "")).strip() and not data.get("raw"):
            self.last_text = str(data["text"])
        elif event.kind == p.EV_USAGE:
            self.usage_seen = True
            for key in USAGE_KEYS:
                try:
                    self.usage[key] += max(0, int(data.get(key) or 0))
                except (TypeError, ValueError):
                    pass
        elif event.kind == p.EV_REQUIRES_ACTION:
            self.requires_action = {"kind": data.get("kind") or "confirmation", "items": list(data.get("items") or [])}
        elif event.kind == p.EV_OUTCOME:
            self.outcome = dict(data)
        elif event.kind == p.EV_ERROR:
            if data.get("kind") == "auth":
                self.auth_error = str(data.get("message") or "")
            if data.get("fatal"):  # the CLI said the turn failed (it may still exit 0)
                self.fatal_error = dict(data)


class TurnRunner:
    def __init__(self, request: TurnRequest, *, allowed_cwds: tuple[str, ...], default_backend: str,
                 sigint_timeout_s: float, reporter: Reporter, sampler: TreeSampler | None = None,
                 on_change: Callable[[], None] | None = None, backend: Any = None,
                 environ: dict[str, str] | None = None, registry: Any = None):
        self.request = request
        self.turn = request.turn
        self.allowed_cwds = allowed_cwds
        self.backend_name = request.backend or default_backend
        self.sigint_timeout_s = sigint_timeout_s
        self.reporter = reporter
        self.sampler = sampler
        self.on_change = on_change or (lambda: None)
        self.backend = backend
        self.environ = dict(os.environ if environ is None else environ)
        self.registry = registry            # agents.orphans.RunningRegistry: survives a daemon crash
        self.agent: AgentProcess | None = None
        self.status = "pending"            # as last reported: pending | running | requires_action | <final>
        self.summary = TurnSummary()
        self.stdout_lines = 0
        self.done = asyncio.Event()
        self.stop_reason: str | None = None  # user | timeout | shutdown
        self.stop_task: asyncio.Task | None = None
        self.stop_result: StopResult | None = None
        self._events: list[dict] = []
        self._batch_bytes = 0
        self._recent: deque[p.AgentEvent] = deque(maxlen=FINISH_EVENTS_KEEP)
        # Reports are redacted (and made storable) before they reach the spool: nothing raw on disk.
        self._redactor = StreamRedactor()
        self._requires_action_reported = False
        self._tasks: list[asyncio.Task] = []
        self.started_at: float | None = None
        self.timeout_s: float | None = None
        self.quiet_since: float | None = None   # monotonic: the agent's last stdout line (or its spawn)
        self._activity: ActivitySampler | None = None

    # ------------------------------------------------------------------ state for the daemon
    def held(self) -> bool:
        """A live agent process for this turn exists (the probe's answer)."""
        return self.agent is not None and not self.agent.exited()

    def running_turn(self) -> p.RunningTurn | None:
        if not self.held():
            return None
        return p.RunningTurn(turn=self.turn, session=self.request.session, pid=self.agent.pid, pgid=self.agent.pgid,
                             started_at=self.agent.spawned_at, process_start_time=self.agent.record.start_time)

    def activity(self) -> dict | None:
        """The heartbeat's sample of this turn (stall evidence for the portal, issue 12): how long
        the agent has printed nothing and what its process tree does meanwhile, redacted.
        Blocking (psutil): call it in a worker thread.  None while no agent runs."""
        agent = self.agent
        if agent is None or agent.exited():
            return None
        if self._activity is None:
            self._activity = ActivitySampler(agent.tracker)
        sample = self._activity.sample()
        quiet_since = self.quiet_since if self.quiet_since is not None else time.monotonic()
        sample.update(turn=self.turn, silent_s=round(max(0.0, time.monotonic() - quiet_since), 1),
                      stdout_lines=self.stdout_lines)
        return ingest(sample)

    # ------------------------------------------------------------------ reporting
    def _advance(self, status: str | None, **fields) -> None:
        self.flush_events()
        report = ingest(p.AdvanceReport(report_id=p.new_report_id(), status=status, **fields).as_dict())
        self.reporter.advance(self.turn, report)
        if status is not None:
            self.status = status

    def flush_events(self) -> None:
        if self._events:
            batch, self._events, self._batch_bytes = self._events, [], 0
            self.reporter.events(self.turn, batch)

    def _add_events(self, events: list[p.AgentEvent]) -> None:
        for event in events:
            self.summary.add(event)
            self._recent.append(event)
            item = self._redactor.event(event.as_dict())
            size = len(json.dumps(item, default=str))
            if size > EVENT_STRING_MAX:
                item = _shrink(item)
                size = len(json.dumps(item, default=str))
            if self._events and self._batch_bytes + size > BATCH_BYTES_MAX:
                self.flush_events()
            self._events.append(item)
            self._batch_bytes += size
            if event.kind == p.EV_REQUIRES_ACTION:
                self._tasks.append(asyncio.get_running_loop().create_task(self._requires_action_later()))
        if len(self._events) >= EVENT_BATCH_MAX:
            self.flush_events()

    def _fail(self, reason: str, kind: str, summary: str, details: str = "", *, exit_code: int | None = None,
              signal: str | None = None, **fields) -> None:
        """Report the turn interrupted with a wake error (SPEC §3.1); ``fields`` go into the report."""
        wake = {"kind": kind, "summary": summary[:SUMMARY_MAX], "source": self.backend_name, "details": details}
        if exit_code is not None:
            wake["exit_code"] = exit_code
        if signal is not None:
            wake["signal"] = signal
        self._advance(p.INTERRUPTED, reason=reason, wake_error=wake, **fields)

    # ------------------------------------------------------------------ the turn
    async def run(self) -> None:
        try:
            await self._run()
        except Exception as exc:  # noqa: BLE001 — the turn must end with a report, never silently
            log.exception("turn %s: daemon error", self.turn)
            if self.held():  # never leave an agent nobody watches
                await self.agent.kill_tree()
            if self.status in ("pending", "running", "requires_action"):
                self._fail("crash", "protocol", f"the daemon failed while running the turn: {exc}"[:SUMMARY_MAX])
        finally:
            for task in self._tasks:
                task.cancel()
            if self.agent is not None:
                self.agent.close()
                if self.registry is not None:  # the last report is spooled: nothing to recover
                    self.registry.remove(self.turn)
            self.done.set()
            self.on_change()

    async def _run(self) -> None:
        request = self.request
        if self.stop_reason is not None:  # stopped while it waited in the queue
            self._advance(p.INTERRUPTED, reason=self.stop_reason, stop_state=p.STOP_CONFIRMED)
            return
        problem = cwd_problem(request.cwd, self.allowed_cwds)
        if problem:
            self._fail("invalid_path", "invalid_path", problem,
                       details=f"cwd: {request.cwd}\nallowed: {', '.join(self.allowed_cwds)}")
            return
        cwd = os.path.realpath(request.cwd)
        try:
            backend = self.backend or load_backend(self.backend_name, self.environ)
            widen = {"allow_tools": request.allow_tools} if request.allow_tools else {}
            spec = backend.command(prompt=request.prompt, cwd=cwd, backend_session_id=request.backend_session_id,
                                   env=dict(request.env), **widen)
        except Exception as exc:  # noqa: BLE001 — unknown backend, or an adapter refusing its input
            self._fail("crash", "spawn_failed", f"{self.backend_name}: cannot build the command: {exc}")
            return
        self.backend = backend
        env = {**{k: v for k, v in self.environ.items() if k not in SCRUBBED_ENV}, **request.env,
               **{str(k): str(v) for k, v in (spec.env or {}).items()}}
        try:
            self.agent = await AgentProcess.start(list(spec.argv), cwd=spec.cwd or cwd, env=env,
                                                  stdin_text=spec.stdin, marker=self.turn, sampler=self.sampler)
        except SpawnError as exc:
            self._fail("crash", "spawn_failed", f"{self.backend_name} could not be started: {exc}",
                       details=f"command: {' '.join(spec.argv)[:2000]}\ncwd: {spec.cwd or cwd}")
            return
        self.started_at = time.time()
        self.quiet_since = time.monotonic()
        if self.registry is not None:
            agent = self.agent
            self.registry.add({"turn": self.turn, "session": request.session, "pid": agent.pid, "pgid": agent.pgid,
                               "start_time": agent.record.start_time, "spawned_at": agent.spawned_at,
                               "marker": self.turn, "cwd": cwd, "cmdline": agent.record.cmdline})
        self._advance(p.RUNNING, pid=self.agent.pid)
        self.on_change()
        log.info("turn %s: %s started, pid %s, in %s", self.turn, self.backend_name, self.agent.pid, cwd)

        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_stdout(), name=f"stdout-{self.turn}")
        self._tasks.append(loop.create_task(self._flush_periodically(), name=f"flush-{self.turn}"))
        timeout = request.timeout_s or getattr(backend, "default_timeout_s", None)
        if timeout:
            self._tasks.append(loop.create_task(self._time_limit(float(timeout)), name=f"limit-{self.turn}"))
        if self.stop_reason is not None and self.stop_task is None:  # interrupted while spawning
            self.stop_task = loop.create_task(self._stop(self.sigint_timeout_s))

        returncode = await self.agent.wait_exit()
        self.on_change()  # no longer held: the snapshot drops it
        try:
            await asyncio.wait_for(asyncio.shield(reader), STDOUT_DRAIN_S)
        except asyncio.TimeoutError:
            reader.cancel()  # a leftover process holds stdout open; the turn has ended anyway
            await asyncio.gather(reader, return_exceptions=True)
        await self.agent.finish_io()
        try:
            self._add_events(list(backend.finish(list(self._recent)) or []))
        except Exception:  # noqa: BLE001
            log.exception("turn %s: backend finish() failed", self.turn)
        self.flush_events()

        if self.stop_task is not None:
            await asyncio.shield(self.stop_task)
        await self._report_exit(returncode, cwd)

    async def _read_stdout(self) -> None:
        async for line in self.agent.lines():
            self.stdout_lines += 1
            self.quiet_since = time.monotonic()
            try:
                events = self.backend.parse_line(line)
            except Exception:  # noqa: BLE001 — parse_line promises not to raise; be safe anyway
                log.exception("turn %s: parse_line failed", self.turn)
                events = [p.AgentEvent(p.EV_TEXT, {"text": line[:2000], "raw": True})]
            if events:
                self._add_events(events)

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(EVENT_FLUSH_S)
            self.flush_events()

    async def _requires_action_later(self) -> None:
        await asyncio.sleep(REQUIRES_ACTION_GRACE_S)
        if self.held() and self.summary.requires_action and self.stop_reason is None \
                and not self._requires_action_reported and self.status == p.RUNNING:
            self._requires_action_reported = True
            self._advance(p.REQUIRES_ACTION, requires_action=self.summary.requires_action,
                          backend_session_id=self.summary.backend_session_id)

    async def _time_limit(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if self.held() and self.stop_task is None:
            log.warning("turn %s: time limit of %g s reached; stopping", self.turn, seconds)
            self.stop_reason = "timeout"
            self.timeout_s = seconds
            self.stop_task = asyncio.get_running_loop().create_task(self._stop(self.sigint_timeout_s))

    # ------------------------------------------------------------------ stopping
    def interrupt(self, *, reason: str = "user", timeout_s: float | None = None) -> bool:
        """Start the verified stop (or mark a not-yet-spawned turn stopped). False if already stopping."""
        if self.stop_reason is not None or (self.agent is not None and self.agent.exited()):
            return False  # already stopping, or exited: its own final report is on the way
        self.stop_reason = reason
        if self.agent is not None and self.stop_task is None:
            self.stop_task = asyncio.get_running_loop().create_task(
                self._stop(self.sigint_timeout_s if timeout_s is None else timeout_s), name=f"stop-{self.turn}")
        return True

    def escalate_now(self) -> None:
        if self.agent is not None:
            self.agent.escalate_now()

    async def _stop(self, timeout_s: float) -> None:
        agent = self.agent
        backend = self.backend
        protocol_stop = None
        if hasattr(backend, "protocol_stop"):
            protocol_stop = lambda: bool(backend.protocol_stop(agent.process))  # noqa: E731
        on_stage = self._stop_stage if self.stop_reason == "user" else None
        self.stop_result = await agent.stop(timeout_s=timeout_s, protocol_stop=protocol_stop, on_stage=on_stage)
        log.info("turn %s: stop (%s) %s%s", self.turn, self.stop_reason,
                 "confirmed" if self.stop_result.confirmed else "NOT confirmed",
                 " after SIGKILL" if self.stop_result.escalated else "")

    async def _stop_stage(self, stage: str) -> None:
        # Stop progress only (no status): the portal moves stop_state requested → signalled → escalated.
        self._advance(None, stop_state=stage)

    # ------------------------------------------------------------------ the last report
    async def _report_exit(self, returncode: int, cwd: str) -> None:
        agent = self.agent
        changes = await asyncio.to_thread(collect_changes, cwd, agent.spawned_at)
        summary = self.summary
        final_reply = summary.final_reply
        common: dict[str, Any] = {
            "backend_session_id": summary.backend_session_id, "final_reply": final_reply,
            "usage": dict(summary.usage) if summary.usage_seen else None, "changes": changes,
            "outcome": summary.outcome,
        }
        if self.stop_reason is not None:
            result = self.stop_result
            survivors = result.survivors if result else await agent.leftovers()
            fields = dict(common, background_processes=[r.as_report() for r in survivors] or None)
            if result is not None and result.confirmed:
                fields["stop_state"] = p.STOP_CONFIRMED
            if self.stop_reason == "timeout":
                self._fail("timeout", "timeout", f"{self.backend_name} exceeded its time limit of {self.timeout_s:g} s",
                           details=agent.diagnostics(), **fields)
            else:
                self._advance(p.INTERRUPTED, reason=self.stop_reason, **fields)
            return

        leftovers = await agent.leftovers()
        if leftovers:
            log.warning("turn %s: the agent left %d process(es) running: %s", self.turn, len(leftovers),
                        [r.pid for r in leftovers])
        common["background_processes"] = [r.as_report() for r in leftovers] or None
        if returncode == 0 and summary.fatal_error is None:
            if summary.requires_action is not None:
                # Sent once: at exit if the agent exited right after asking (the usual case).
                self._advance(p.REQUIRES_ACTION, requires_action=summary.requires_action, **common)
            else:
                self._advance(p.ENDED, **common)
            return
        kind, text = self._classify_failure(returncode)
        self._fail("crash", kind, text, details=agent.diagnostics(),
                   exit_code=returncode if returncode >= 0 else None,
                   signal=_signal_name(-returncode) if returncode < 0 else None, **common)

    def _classify_failure(self, returncode: int) -> tuple[str, str]:
        hint = _last_line(self.agent.stderr_tail.text()) or _last_line(self.agent.stdout_tail.text())
        name = self.backend_name
        try:  # the backend knows its CLI's words for a failure (a refused key, an unknown session)
            failure = getattr(self.backend, "failure", None)
            told = failure(list(self._recent), returncode, self.agent.stderr_tail.text()) if failure else None
        except Exception:  # noqa: BLE001
            log.exception("turn %s: backend failure() failed", self.turn)
            told = None
        if told and returncode >= 0:
            return told
        if returncode < 0:
            return "signal", f"{name} was killed by {_signal_name(-returncode)}" + (f": {hint}" if hint else "")
        if self.summary.auth_error is not None:
            return "auth", f"{name} is not logged in or lacks credentials: {self.summary.auth_error or hint}"
        if self.stdout_lines == 0:
            # Nothing on stdout at all: it failed before starting work (missing login, broken install).
            return "spawn_failed", f"{name} failed to start (exit code {returncode})" + (f": {hint}" if hint else "")
        return "exited_nonzero", f"{name} exited with code {returncode}" + (f": {hint}" if hint else "")


def load_backend(name: str, environ: dict[str, str] | None = None):
    from agents.backends import get_backend  # only when a turn starts: the process layer needs none

    return get_backend(name, environ)


def _shrink(value: Any) -> Any:
    """The event with every long string cut to EVENT_STRING_MAX characters (and said so)."""
    if isinstance(value, str):
        if len(value) <= EVENT_STRING_MAX:
            return value
        return value[:EVENT_STRING_MAX] + f"… [cut by the daemon: {len(value)} characters]"
    if isinstance(value, dict):
        return {k: _shrink(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shrink(v) for v in value[:1000]]
    return value


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(text: str) -> str:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line:
            return line[:200]
    return ""
