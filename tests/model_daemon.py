"""A modelled daemon for the stateful test (tests/test_invariants_stateful.py, SPEC §11 R4).

It plays agents/daemon.py's part against the portal's real functions, in-process and in the test's
transaction: the frames go through the schemas and the bridge functions the WebSocket consumer calls
(``frame_in`` mirrors ``DaemonConsumer._handle``), commands come from ``bridge.commands_to_deliver``,
reports go through ``bridge.report_advance`` / ``bridge.report_events`` (the daemon routes' functions,
idempotency included) and each answer is judged by the spool's own ``agents.spool.classify``.

What it models of the daemon (agents/daemon.py, agents/spool.py, agents/orphans.py):

* ``procs`` — the agent processes it holds (turn → session).  A process lives until the daemon ends
  it (an interrupt) or the agent exits; while it lives the turn is *held* here, whatever the portal
  thinks.  At most one process per session; a start for a busy session waits in ``queue``.
* A start for a turn it knows (held, queued, finished, or with spooled/parked reports) is ignored.
* Acks and results are frames on the socket: they may land later (``outbox``), or be lost with the
  link (then the command is delivered again and acked again, acted on once).
* Reports are spooled first and sent per turn in order; ``classify`` decides: done (removed),
  retry (kept), refused (kept, asked again, parked after ``PARK_AFTER`` refusals with the answer as
  the recorded reason, unparked on the next reconnect).  Nothing leaves the spool otherwise.
* Away: a lost link (disconnect, later hello + snapshot) or a frozen daemon (SIGSTOP: no heartbeat,
  the socket stays up; after SIGCONT its heartbeat lists what it holds).  Processes go on meanwhile.
* Killed (SIGKILL) and started again: its queue and memory are lost; orphan recovery stops the
  processes it had and reports them ``interrupted(shutdown)``; the spool survives.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from django.utils import timezone

from agents import protocol, spool
from chorus_site.errors import ApplicationError
from sessions_app import bridge, daemon_schemas
from sessions_app.models import Connection

# The real sender asks a refused report again spool.REFUSED_ATTEMPTS times over about a minute; the
# model parks sooner so that parking and unparking happen within a short example.
PARK_AFTER = 2
HELLO = {"version": "model", "backends": ["scripted"], "max_concurrency": 8}


@dataclass
class Report:
    seq: int
    turn: str
    path: str            # "advance" | "events"
    body: dict
    refusals: int = 0
    answers: list = field(default_factory=list)   # (status, code) of each answer

    @property
    def id(self) -> str:
        return self.body["report_id"]


def frame_in(connection_id, message: dict) -> None:
    """A frame from the daemon, as ``DaemonConsumer._handle`` takes it (validated, then the bridge)."""
    kind = message["type"]
    frame = daemon_schemas.validated(daemon_schemas.FRAMES[kind], message)
    if kind == protocol.HEARTBEAT:
        running = None if frame.running is None else [str(turn) for turn in frame.running]
        bridge.connection_heartbeat(connection_id=connection_id, spool=None, running=running)
    elif kind == protocol.HELLO:
        bridge.connection_daemon_connected(connection_id=connection_id,
                                           hello=frame.model_dump(mode="json", exclude_none=True))
    elif kind == protocol.SNAPSHOT:
        queued = None if frame.queued is None else [str(turn) for turn in frame.queued]
        bridge.connection_store_snapshot(connection_id=connection_id, running=frame.model_dump(mode="json")["running"],
                                         queued=queued)
    elif kind == protocol.ACK:
        bridge.command_acked(connection_id=connection_id, command_id=frame.command)
    elif kind == protocol.RESULT:
        bridge.command_result(connection_id=connection_id, command_id=frame.command, result=frame.result)


class ModelDaemon:
    def __init__(self, connection: Connection, *, on_command, on_answer):
        self.connection = connection
        self.on_command = on_command      # (daemon, command dict) -> None: the test's check
        self.on_answer = on_answer        # (daemon, report, status, answer) -> None
        self.linked = True                # its socket is up
        self.frozen = False               # SIGSTOP'd: nothing at all happens in it
        self.procs: dict[str, str] = {}
        self.listed_at = None             # when it last sent the portal what it holds (heartbeat, snapshot)
        self.queue: list[tuple[str, str]] = []
        self.finished: set[str] = set()
        self.seen: set[str] = set()
        self.outbox: list[dict] = []
        self.spool: list[Report] = []
        self.parked: list[Report] = []
        self.delivered: dict[str, int] = {}   # report id -> 2xx status
        self.produced: dict[str, Report] = {}
        self._seq = 0
        self.pid = 4000

    # ---------------------------------------------------------------- state
    @property
    def pk(self):
        return self.connection.pk

    @property
    def serving(self) -> bool:
        return self.linked and not self.frozen

    def knows(self, turn: str) -> bool:
        return (turn in self.procs or turn in self.finished or any(t == turn for t, _ in self.queue)
                or any(r.turn == turn for r in self.spool + self.parked))

    def report(self, turn: str, path: str = "advance", **body) -> None:
        self._seq += 1
        entry = Report(seq=self._seq, turn=turn, path=path, body={"report_id": str(uuid.uuid4()), **body})
        self.spool.append(entry)
        self.produced[entry.id] = entry

    # ---------------------------------------------------------------- frames
    def send_frame(self, message: dict) -> None:
        if self.serving:
            frame_in(self.pk, message)

    def land_outbox(self) -> None:
        while self.serving and self.outbox:
            frame_in(self.pk, self.outbox.pop(0))

    def heartbeat(self) -> None:
        self._listed()
        self.send_frame({"type": protocol.HEARTBEAT, "running": sorted(self.procs)})

    def snapshot(self) -> None:
        running = [{"turn": turn, "session": session, "pid": self.pid, "pgid": self.pid, "started_at": 1.0,
                    "process_start_time": 1.0} for turn, session in sorted(self.procs.items())]
        self._listed()
        self.send_frame({"type": protocol.SNAPSHOT, "running": running, "queued": [t for t, _ in self.queue]})

    def _listed(self) -> None:
        """When the portal last heard it list the processes it holds (before the frame, so a settle the
        frame causes is not taken as later than it)."""
        if self.serving:
            self.listed_at = timezone.now()

    # ---------------------------------------------------------------- commands
    def take_commands(self, *, acks_land: bool) -> None:
        """The consumer's push: every pending (or delivered, unacked) command, acked and acted on."""
        if not self.serving:
            return
        for command in bridge.commands_to_deliver(connection_id=self.pk):
            self.on_command(self, command)
            self.outbox.append({"type": protocol.ACK, "command": command["id"]})
            if command["id"] in self.seen:
                continue
            self.seen.add(command["id"])
            turn, action = command["turn"], command["action"]
            if action in (protocol.START_TURN, protocol.RESUME):
                self.start(turn, command["payload"]["session"])
            elif action == protocol.INTERRUPT:
                result = self.interrupt(turn)
                if result is not None:
                    self.outbox.append({"type": protocol.RESULT, "command": command["id"], "result": result})
            elif action == protocol.PROBE:
                self.outbox.append({"type": protocol.RESULT, "command": command["id"],
                                    "result": {"held": turn in self.procs}})
        if acks_land:
            self.land_outbox()

    def start(self, turn: str, session: str) -> None:
        if self.knows(turn):
            return
        self.queue.append((turn, session))
        self.pump()

    def pump(self) -> None:
        for turn, session in list(self.queue):
            if session not in self.procs.values():
                self.queue.remove((turn, session))
                self.pid += 1
                self.procs[turn] = session
                self.report(turn, status=protocol.RUNNING, pid=self.pid)

    def interrupt(self, turn: str) -> dict | None:
        """As daemon.interrupt_turn: stop what is held; say "not held" of a turn never held here."""
        if turn in self.procs:
            self.exit(turn, dict(status=protocol.INTERRUPTED, reason="user", stop_state=protocol.STOP_CONFIRMED))
            return None
        for queued in list(self.queue):
            if queued[0] == turn:  # never started: settled at once
                self.queue.remove(queued)
                self.finished.add(turn)
                self.report(turn, status=protocol.INTERRUPTED, reason="user", stop_state=protocol.STOP_CONFIRMED)
                return None
        if turn in self.finished or any(r.turn == turn for r in self.spool):
            self.report(turn, status=protocol.INTERRUPTED, reason="user", stop_state=protocol.STOP_CONFIRMED)
            return None
        return {"held": False}

    def exit(self, turn: str, *bodies: dict) -> None:
        """The turn's process ends (the agent exited, or was stopped): its last reports are spooled."""
        del self.procs[turn]
        self.finished.add(turn)
        for body in bodies:
            body = dict(body)
            self.report(turn, body.pop("path", "advance"), **body)
        self.pump()

    # ---------------------------------------------------------------- reports
    def flush(self) -> None:
        """Send the spool, lane by lane in order, until each lane is empty or waits."""
        if not self.serving:
            return
        for lane in dict.fromkeys(r.turn for r in self.spool):
            while True:
                entry = next((r for r in self.spool if r.turn == lane), None)
                if entry is None or not self._send(entry):
                    break

    def _send(self, entry: Report) -> bool:
        """One attempt; True if the lane may go on (delivered or parked)."""
        try:
            fn = bridge.report_advance if entry.path == "advance" else bridge.report_events
            status, answer, _ = fn(connection=Connection.objects.get(pk=self.pk), turn_id=entry.turn,
                                   report=dict(entry.body))
            text = json.dumps(answer)
        except ApplicationError as error:  # what the API answers: the §8 body with its status
            status, answer, text = error.status, None, json.dumps(error.as_body())
        entry.answers.append((status, spool.error_code(text)))
        outcome = spool.classify(status, text)
        if outcome == "done":
            self.on_answer(self, entry, status, answer)
            self.spool.remove(entry)
            self.delivered[entry.id] = status
            return True
        if outcome == "refused":
            entry.refusals += 1
            if entry.refusals >= PARK_AFTER:
                self.spool.remove(entry)
                self.parked.append(entry)
                return True
        return False

    # ---------------------------------------------------------------- presence
    def go_away(self, how: str) -> None:
        """The link is lost (``disconnect``) or the daemon freezes (``freeze``); time passes."""
        if how == "freeze":
            self.frozen = True
        elif self.linked:
            self.linked = False
            self.outbox.clear()  # frames in flight die with the socket
            bridge.connection_daemon_disconnected(connection_id=self.pk)
        Connection.objects.filter(pk=self.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))

    def come_back(self, *, acks_land: bool = True) -> None:
        if self.frozen:  # SIGCONT: the same socket; the next heartbeat lists what it holds
            self.frozen = False
            self.land_outbox()
            self.heartbeat()
        if not self.linked:
            self.linked = True
            self.send_frame({"type": protocol.HELLO, **HELLO, "cwds": list(self.connection.cwds)})
            self.snapshot()
            # The sender asks the parked reports again after a reconnect (ReportSender.unpark).
            for entry in self.parked:
                entry.refusals = 0
            self.spool = sorted(self.spool + self.parked, key=lambda r: r.seq)
            self.parked = []
        self.take_commands(acks_land=acks_land)
        self.flush()

    def killed_and_restarted(self) -> None:
        """SIGKILL, then a new start: the queue and memory are gone, the spool is not; orphan recovery
        stops the processes of the earlier run and reports them ``interrupted(shutdown)``."""
        for turn in sorted(self.procs):
            self.report(turn, status=protocol.INTERRUPTED, reason="shutdown")
        self.procs.clear()
        self.queue.clear()
        self.finished.clear()
        self.seen.clear()
        self.outbox.clear()
        self.frozen = False
        if self.linked:
            self.linked = False
            bridge.connection_daemon_disconnected(connection_id=self.pk)
        self.come_back()
