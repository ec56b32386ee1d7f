"""The Chorus daemon (SPEC §5): holds a connection to the portal and runs agent turns on this machine.

    python manage.py chorus_daemon --portal URL --key KEY [--cwd DIR ...]
    python -m agents.daemon --portal URL --key KEY ...          (the same, without Django)

* **Connection** — WebSocket ``/ws/daemon/`` with ``Authorization: Bearer KEY``. On connect: ``hello``
  then a ``snapshot`` of the running set (and of the turns queued here); a ``heartbeat`` every
  HEARTBEAT_INTERVAL_S listing the running turns; a snapshot on every change of the running set. Any
  disconnect → reconnect with exponential backoff (0.5 s doubling, capped at 2 s, ±20 % jitter,
  back to 0.5 s once the portal welcomes us). Agents keep running while disconnected; their reports
  wait in the spool. The portal reconciles with what we say we hold (sessions_app/reconcile.py).
* **Commands** — every ``command`` is acked. A command id seen before is acked again (and a probe's
  result sent again) but acted on once. ``start_turn``/``resume`` queue a turn; ``interrupt`` stops
  one (§4.1); ``probe`` answers ``{"held": bool}``.
* **Local queue** — at most ``max_concurrency`` agents run at once and at most one turn per session.
  A start beyond capacity, or for a session with a turn still running here, waits in an in-memory
  FIFO and starts as soon as both allow (a blocked session does not hold up other sessions). The
  portal still shows such a turn ``pending``. An interrupt of a queued turn settles it at once
  (``interrupted(user)``, never started); a shutdown settles queued turns ``interrupted(shutdown)``.
  A daemon killed with SIGKILL loses its queue (the commands were acked); the portal's reconcile
  finds those turns by the snapshot.
* **Reports** — through the spool (``agents.spool``): on disk first, sent in order per turn, retried
  until the portal answers; spooled reports of an earlier run go first.
* **Shutdown** (SIGTERM / SIGINT) — stop taking commands (they are not acked, so the portal replays
  them to the next run), stop queued and running turns (reported ``interrupted(shutdown)``, the
  verified stop with the usual deadline; a second signal kills at once), flush the spool for up to
  SHUTDOWN_FLUSH_S, exit. Unsent reports stay spooled for the next start.

Like the rest of the daemon side of ``agents/``, this module imports nothing of the portal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import sys
import time
from collections import OrderedDict, deque
from typing import Any, Callable

from agents import protocol as p
from agents.daemon_config import ConfigError, DaemonConfig
from agents.orphans import RunningRegistry, recover_orphans
from agents.process import TreeSampler
from agents.runner import TurnRequest, TurnRunner, load_backend
from agents.spool import (
    ReportSender,
    Spool,
    SpoolLocked,
    make_poster,
    report_path_advance,
    report_path_events,
)

log = logging.getLogger("chorus.daemon")

DAEMON_VERSION = "0.1.0"
RECONNECT_FIRST_S = 0.5
# Short: while the portal is away its sweep may settle our running turns offline; the sooner we are
# back, the sooner our snapshot reopens them (and a restarted portal is reached within ~2 s).
RECONNECT_CAP_S = 2.0
REPLACED_RETRY_S = 30.0        # after another socket with our key took over (see _connection_loop)
SEEN_COMMANDS_MAX = 10000
FINISHED_TURNS_MAX = 10000
SHUTDOWN_FLUSH_S = 5.0
SIGNAL_DEBOUNCE_S = 1.0        # Ctrl-C under a supervisor: the tty's SIGINT and the parent's SIGTERM are one request
WS_MAX_MESSAGE = 4 * 1024 * 1024


class SpoolReporter:
    """The runners' ``Reporter``: each report is spooled, then sent in order per turn."""

    def __init__(self, sender: ReportSender):
        self.sender = sender

    def advance(self, turn: str, report: dict) -> None:
        self.sender.submit(lane=turn, path=report_path_advance(turn), body=report)

    def events(self, turn: str, events: list[dict]) -> None:
        self.sender.submit(lane=turn, path=report_path_events(turn), body={"report_id": p.new_report_id(),
                                                                          "events": events})


class Backoff:
    """Reconnect delays: RECONNECT_FIRST_S doubling up to RECONNECT_CAP_S, ±20 % jitter; ``reset()``
    once the portal serves us (its welcome)."""

    def __init__(self, first_s: float = RECONNECT_FIRST_S, cap_s: float = RECONNECT_CAP_S):
        self.first_s, self.cap_s = first_s, cap_s
        self.delay = first_s

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.cap_s, self.delay * 2)
        return delay * (0.8 + 0.4 * random.random())  # noqa: S311 — jitter, not security

    def reset(self) -> None:
        self.delay = self.first_s


class Daemon:
    def __init__(self, config: DaemonConfig, *, poster=None, connect: Callable | None = None,
                 environ: dict[str, str] | None = None, install_signals: bool = True):
        self.config = config
        self._poster = poster
        self._connect = connect
        self.environ = environ
        self.install_signals = install_signals
        self.runners: dict[str, TurnRunner] = {}          # queued or started, not finished
        self.tasks: dict[str, asyncio.Task] = {}          # turn -> its run() task
        self.queue: deque[TurnRunner] = deque()
        self.finished: OrderedDict[str, str] = OrderedDict()
        # The agent of a finished turn: what it left running is still the turn's, so a later interrupt
        # stops it before saying "confirmed" (bounded like ``finished``).
        self.finished_agents: OrderedDict[str, Any] = OrderedDict()
        self.leftover_stops: set[asyncio.Task] = set()
        self.seen_commands: OrderedDict[str, dict | None] = OrderedDict()  # id -> result sent (or None)
        self.ws = None
        self.connection_id: str | None = None
        self.heartbeat_interval_s = float(p.HEARTBEAT_INTERVAL_S)
        self.stopping = False
        self.shutdown_signals = 0
        self._shutdown = asyncio.Event()
        self._snapshot_due = False
        self.connected = asyncio.Event()   # set while a WebSocket is open (tests wait on it)
        self.sender: ReportSender | None = None
        self.reporter: SpoolReporter | None = None
        self.spool: Spool | None = None
        self.sampler: TreeSampler | None = None
        self.registry: RunningRegistry | None = None
        self.recovering: set[str] = set()  # turns an earlier, killed run left behind (agents.orphans)
        self._first_signal_at = 0.0
        self._background: set[asyncio.Task] = set()
        self.backoff = Backoff()

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
        self.spool = Spool(self.config.spool_dir)
        poster = self._poster or make_poster(self.config.api_url(""), self.config.key,
                                             user_agent=f"chorus-daemon/{DAEMON_VERSION}")
        self.sender = ReportSender(self.spool, poster)
        self.reporter = SpoolReporter(self.sender)
        self.sampler = TreeSampler()
        backlog = self.sender.load_pending()
        for lane in self.sender.lanes():
            # An earlier run worked on these turns (its reports wait here): a start the portal sends
            # again for one of them is never acted on (a turn runs at most once per daemon spool).
            self.finished.setdefault(lane, "earlier run")
        if backlog:
            log.info("sending %d report(s) left in the spool by an earlier run", backlog)
        self.registry = RunningRegistry(os.path.join(self.config.spool_dir, "running"))
        orphans = self.registry.load()
        loop = asyncio.get_running_loop()
        recovery = None
        if orphans:
            log.warning("%d turn(s) were running when this daemon last died; stopping what is left of them",
                        len(orphans))
            self.recovering = {str(r["turn"]) for r in orphans}
            recovery = loop.create_task(self._recover(orphans), name="recover-orphans")
        if self.install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown)
        log.info("daemon %s: portal %s, cwds %s, backend %s, max %d at once, spool %s", DAEMON_VERSION,
                 self.config.portal_url, ", ".join(self.config.cwds), self.config.backend,
                 self.config.max_concurrency, self.config.spool_dir)
        link = loop.create_task(self._connection_loop(), name="portal-link")
        try:
            await self._shutdown.wait()
            await self._stop_everything(also_wait_for=[recovery] if recovery is not None else [])
        finally:
            link.cancel()
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(link, *self._background, return_exceptions=True)
            await self.sender.close()
            await self.sampler.close()
            self.spool.close()
            if self.install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
        left = self.spool.count()
        log.info("daemon stopped%s", f"; {left} report(s) stay spooled for the next start" if left else "")
        return 0

    async def _recover(self, orphans: list[dict]) -> None:
        try:
            await recover_orphans(orphans, self.registry, reporter=self.reporter, sampler=self.sampler,
                                  sigint_timeout_s=self.config.sigint_timeout_s)
        except Exception:  # noqa: BLE001
            log.exception("recovering the turns of an earlier run failed")
        finally:
            self.recovering.clear()

    def request_shutdown(self) -> None:
        now = time.monotonic()
        if self.shutdown_signals and now - self._first_signal_at < SIGNAL_DEBOUNCE_S:
            return
        self.shutdown_signals += 1
        if self.shutdown_signals == 1:
            self._first_signal_at = now
            log.info("shutting down: stopping %d turn(s)", len(self.runners))
            self.stopping = True
            self._shutdown.set()
        else:
            log.warning("second stop signal: killing the agents' process trees now")
            for runner in list(self.runners.values()):
                runner.escalate_now()

    async def _stop_everything(self, also_wait_for: list[asyncio.Task] = ()) -> None:
        self.stopping = True
        while self.queue:
            runner = self.queue.popleft()
            runner.interrupt(reason="shutdown")
            self._launch(runner)
        for runner in list(self.runners.values()):
            runner.interrupt(reason="shutdown", timeout_s=self.config.sigint_timeout_s)
            if self.shutdown_signals > 1:
                runner.escalate_now()
        await asyncio.gather(*self.tasks.values(), *also_wait_for, return_exceptions=True)
        await self._send_snapshot()
        if not await self.sender.drain(SHUTDOWN_FLUSH_S):
            log.warning("the portal did not take every report within %g s", SHUTDOWN_FLUSH_S)
        if self.ws is not None:
            try:
                await self.ws.close()
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ the portal link
    async def _connection_loop(self) -> None:
        while True:
            try:
                async with self._open() as ws:
                    self.ws = ws
                    self.connected.set()
                    log.info("connected to %s", self.config.ws_url)
                    await self._on_connected(ws)
                    await self._serve(ws)
                log.info("the portal closed the connection")
                if getattr(ws, "close_code", None) == p.SOCKET_REPLACED_CLOSE:
                    # Another daemon uses this connection's key (or a stale socket of ours was
                    # replaced): do not fight it for the socket every few seconds.
                    log.error("another socket with this connection's key replaced this one; is a second daemon "
                              "running with the same key? trying again in %g s", REPLACED_RETRY_S)
                    await asyncio.sleep(REPLACED_RETRY_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — every failure means: wait, then reconnect
                log.warning("portal connection: %s", _describe_ws_error(exc))
            finally:
                self.ws = None
                self.connected.clear()
            await asyncio.sleep(self.backoff.next())

    def _open(self):
        headers = {"Authorization": f"Bearer {self.config.key}"}
        if self._connect is not None:
            return self._connect(self.config.ws_url, headers)
        from websockets.asyncio.client import connect

        return connect(self.config.ws_url, additional_headers=headers, open_timeout=15, ping_interval=20,
                       ping_timeout=20, close_timeout=5, max_size=WS_MAX_MESSAGE,
                       user_agent_header=f"chorus-daemon/{DAEMON_VERSION}")

    async def _on_connected(self, ws) -> None:
        await self._send({"type": p.HELLO, "version": DAEMON_VERSION, "protocol": p.PROTOCOL_VERSION,
                          "host": socket.gethostname(), "backends": [self.config.backend],
                          "cwds": list(self.config.cwds), "max_concurrency": self.config.max_concurrency,
                          "sigint_timeout_s": self.config.sigint_timeout_s, "spool": self.sender.health()}, ws)
        await self._send_snapshot(ws)
        self.sender.unpark()  # reports the portal refused before are asked again (it may take them now)
        self.sender.kick()  # the portal is reachable: retry waiting reports now

    async def _serve(self, ws) -> None:
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeats(ws), name="heartbeat")
        try:
            async for raw in ws:
                try:
                    message = p.decode(raw)
                except ValueError as exc:
                    log.warning("ignoring a malformed message from the portal: %s", exc)
                    continue
                await self._handle(message, ws)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)

    async def _heartbeats(self, ws) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            # The spool's health rides along: queued reports, parked refusals, the oldest's age.
            # The turns we run ride along too: a portal that settled them offline while we were frozen
            # (the socket stayed open, no new hello or snapshot follows) reopens them at once.
            # And what each running agent's process tree does (stall evidence: waiting on a child or silent).
            await self._send({"type": p.HEARTBEAT, "spool": self.sender.health(),
                              "running": [t["turn"] for t in self.running()],
                              "activity": await self.activity()}, ws)

    async def _send(self, message: dict, ws=None) -> bool:
        ws = ws or self.ws
        if ws is None:
            return False
        try:
            await ws.send(p.encode(message))
            return True
        except Exception as exc:  # noqa: BLE001 — a closed socket: the reconnect resends what matters
            log.debug("could not send %s: %s", message.get("type"), exc)
            return False

    # ------------------------------------------------------------------ messages
    async def _handle(self, message: dict, ws) -> None:
        kind = message["type"]
        if kind == p.WELCOME:
            self.backoff.reset()  # the portal serves us: the next reconnect starts from the first delay
            self.connection_id = message.get("connection")
            try:
                interval = float(message.get("heartbeat_interval_s") or p.HEARTBEAT_INTERVAL_S)
                self.heartbeat_interval_s = min(max(interval, 1.0), 60.0)
            except (TypeError, ValueError):
                pass
            log.info("portal welcomes us as connection %s", self.connection_id)
        elif kind == p.COMMAND:
            await self._on_command(message, ws)
        elif kind == p.ERROR:
            log.warning("portal error %s: %s", message.get("code"), message.get("message"))
        else:
            log.debug("ignoring a %r message", kind)

    async def _on_command(self, command: dict, ws) -> None:
        if self.stopping:
            return  # not acked: the portal replays it to the next run of this daemon
        command_id = str(command.get("id") or "")
        if not command_id:
            log.warning("ignoring a command without id: %s", command)
            return
        await self._send({"type": p.ACK, "command": command_id}, ws)
        if command_id in self.seen_commands:
            result = self.seen_commands[command_id]
            if result is not None:  # the first answer may have been lost with a connection
                await self._send({"type": p.RESULT, "command": command_id, "result": result}, ws)
            return
        self.seen_commands[command_id] = None
        while len(self.seen_commands) > SEEN_COMMANDS_MAX:
            self.seen_commands.popitem(last=False)
        action = command.get("action")
        try:
            if action in (p.START_TURN, p.RESUME):
                self.start_turn(command)
            elif action == p.INTERRUPT:
                result = self.interrupt_turn(command)
                if result is not None:  # not held here: the portal decides (it knows who runs the turn)
                    self.seen_commands[command_id] = result
                    await self._send({"type": p.RESULT, "command": command_id, "result": result}, ws)
            elif action == p.PROBE:
                result = {"held": self.holds(command.get("turn"))}
                self.seen_commands[command_id] = result
                await self._send({"type": p.RESULT, "command": command_id, "result": result}, ws)
            else:
                log.warning("unknown command action %r (command %s)", action, command_id)
        except Exception:  # noqa: BLE001 — one bad command must not take the link down
            log.exception("command %s (%s) failed", command_id, action)

    # ------------------------------------------------------------------ turns
    def holds(self, turn: Any) -> bool:
        if turn and str(turn) in self.recovering:
            return True  # an orphan of an earlier run, being stopped right now
        runner = self.runners.get(str(turn)) if turn else None
        return runner is not None and runner.held()

    def start_turn(self, command: dict) -> None:
        request = TurnRequest.from_command(command)
        if request.env.get("CHORUS_TASK_TOKEN"):
            # The agent talks back to the portal this daemon knows (SPEC §5 "Agents talk back").
            request.env.setdefault("CHORUS_API_URL", self.config.api_url(""))
        if request.turn in self.runners or request.turn in self.finished or request.turn in self.recovering:
            log.info("turn %s is already known here; start ignored", request.turn)
            return
        runner = TurnRunner(request, allowed_cwds=self.config.cwds, default_backend=self.config.backend,
                            sigint_timeout_s=self.config.sigint_timeout_s, reporter=self.reporter,
                            sampler=self.sampler, on_change=self.running_set_changed, environ=self.environ,
                            registry=self.registry)
        self.runners[request.turn] = runner
        self.queue.append(runner)
        self._pump()
        if runner in self.queue:
            log.info("turn %s waits: %d running (max %d)%s", request.turn, len(self.tasks),
                     self.config.max_concurrency, ", its session is busy" if self._session_busy(runner) else "")
            self.running_set_changed()  # the snapshot says it is queued here: taken, not lost

    def interrupt_turn(self, command: dict) -> dict | None:
        """Stop a turn held here; for a turn this daemon knows nothing of, the answer ``{"held": False}``."""
        turn = str(command.get("turn") or "")
        payload = command.get("payload") if isinstance(command.get("payload"), dict) else {}
        timeout = payload.get("sigint_timeout_s")
        try:
            timeout = float(timeout) if timeout is not None else self.config.sigint_timeout_s
        except (TypeError, ValueError):
            timeout = self.config.sigint_timeout_s
        runner = self.runners.get(turn)
        if turn in self.recovering:
            return None  # being stopped already; its report follows
        if runner is None:
            if turn and (turn in self.finished or (self.sender is not None and self.sender.has_pending(turn))):
                # Ours, but its agent already exited (e.g. while waiting for an answer): once what it
                # left running is stopped too, say so (§4.1), after its own last report (one lane per
                # turn keeps the order).  A turn that already ended is refused by the portal.
                task = asyncio.get_running_loop().create_task(
                    self._stop_exited_turn(turn, self.finished_agents.get(turn), timeout), name=f"stop-left-{turn}")
                self.leftover_stops.add(task)
                task.add_done_callback(self.leftover_stops.discard)
                return None
            # Never ran here: a daemon reports only turns it holds.  It says "not held" and the portal
            # settles the turn only if this daemon is the one that runs it.
            return {"held": False} if turn else None
        if runner in self.queue:  # never started: settle it now
            self.queue.remove(runner)
            runner.interrupt(reason="user")
            self._launch(runner)
            return None
        if not runner.interrupt(reason="user", timeout_s=timeout):
            log.info("turn %s: interrupt ignored (already stopping or exited)", turn)
        return None

    async def _stop_exited_turn(self, turn: str, agent, timeout_s: float) -> None:
        """Interrupt of a turn whose agent exited: stop (SIGINT, then SIGKILL) what it left running,
        and report the stop confirmed only when nothing of the turn lives."""
        fields: dict[str, Any] = {"stop_state": p.STOP_CONFIRMED}
        try:
            if agent is not None and await agent.leftovers():
                result = await agent.stop(timeout_s=timeout_s)
                if result.survivors:
                    fields = {"background_processes": [r.as_report() for r in result.survivors]}
                elif not result.confirmed:
                    fields = {}
        except Exception:  # noqa: BLE001 - the stop is still reported, never claimed
            log.exception("turn %s: stopping what its agent left running failed", turn)
            fields = {}
        self.reporter.advance(turn, p.AdvanceReport(report_id=p.new_report_id(), status=p.INTERRUPTED,
                                                    reason="user", **fields).as_dict())

    def _session_busy(self, runner: TurnRunner) -> bool:
        session = runner.request.session or runner.turn
        return any((r.request.session or r.turn) == session for t, r in self.runners.items() if t in self.tasks)

    def _pump(self) -> None:
        """Start every queued turn that capacity and its session allow, oldest first."""
        for runner in list(self.queue):
            if len(self.tasks) >= self.config.max_concurrency:
                break
            if self._session_busy(runner):
                continue
            self.queue.remove(runner)
            self._launch(runner)

    def _launch(self, runner: TurnRunner) -> None:
        task = asyncio.get_running_loop().create_task(runner.run(), name=f"turn-{runner.turn}")
        self.tasks[runner.turn] = task
        task.add_done_callback(lambda _t, turn=runner.turn: self._finished(turn))

    def _finished(self, turn: str) -> None:
        self.tasks.pop(turn, None)
        runner = self.runners.pop(turn, None)
        self.finished[turn] = runner.status if runner else "?"
        while len(self.finished) > FINISHED_TURNS_MAX:
            self.finished.popitem(last=False)
        if runner is not None and runner.agent is not None:
            self.finished_agents[turn] = runner.agent
            while len(self.finished_agents) > FINISHED_TURNS_MAX:
                self.finished_agents.popitem(last=False)
        if not self.stopping:
            self._pump()
        self.running_set_changed()

    # ------------------------------------------------------------------ snapshots
    def running(self) -> list[dict]:
        turns = (runner.running_turn() for runner in self.runners.values())
        return [t.as_dict() for t in turns if t is not None]

    async def activity(self) -> list[dict]:
        """Each running agent's process sample (TurnRunner.activity), taken in a worker thread."""
        runners = list(self.runners.values())

        def work():
            samples = []
            for runner in runners:
                try:
                    sample = runner.activity()
                except Exception:  # noqa: BLE001 — evidence is best effort; the heartbeat must go out
                    log.debug("activity sample of %s failed", runner.turn, exc_info=True)
                    continue
                if sample is not None:
                    samples.append(sample)
            return samples

        return await asyncio.to_thread(work)

    def running_set_changed(self) -> None:
        """Send a snapshot soon (changes in one loop iteration are coalesced into one)."""
        if self._snapshot_due:
            return
        self._snapshot_due = True
        task = asyncio.get_running_loop().create_task(self._send_snapshot())
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    async def _send_snapshot(self, ws=None) -> None:
        self._snapshot_due = False
        await self._send({"type": p.SNAPSHOT, "running": self.running(),
                          "queued": [runner.turn for runner in self.queue],  # taken, not started: not lost
                          "spool": self.sender.health() if self.sender is not None else None}, ws)


def _describe_ws_error(exc: BaseException) -> str:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return f"the portal refused the connection key (HTTP {status}); check --key / CHORUS_DAEMON_KEY"
    if status is not None:
        return f"the portal answered HTTP {status} instead of opening the WebSocket"
    if isinstance(exc, (ConnectionRefusedError, socket.gaierror, TimeoutError, asyncio.TimeoutError)):
        return f"the portal is unreachable ({exc.__class__.__name__}: {exc})"
    return f"{exc.__class__.__name__}: {exc}"


# ------------------------------------------------------------------ entry points

def configure_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger("chorus")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def check_backend(name: str) -> None:
    try:
        load_backend(name)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0] if exc.args else exc)) from None


def main(config: DaemonConfig) -> int:
    """Run the daemon until SIGTERM/SIGINT. Returns the process exit status."""
    configure_logging()
    check_backend(config.backend)
    try:
        return asyncio.run(Daemon(config).run())
    except SpoolLocked as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:  # e.g. the spool directory cannot be created
        log.error("cannot start: %s", exc)
        return 2


def cli(argv: list[str] | None = None) -> int:
    import argparse

    from agents.daemon_config import add_arguments, config_from_sources, options_from_namespace

    parser = argparse.ArgumentParser(prog="python -m agents.daemon", description="The Chorus Ops daemon.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_sources(options_from_namespace(args), config_path=args.config)
        check_backend(config.backend)
    except ConfigError as exc:
        parser.exit(2, f"chorus daemon: {exc}\n")
    return main(config)


if __name__ == "__main__":
    sys.exit(cli())
