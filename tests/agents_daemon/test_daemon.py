"""The daemon loop against a stand-in portal: a real WebSocket server (websockets) for control and
presence, and an in-memory report endpoint. The real portal is exercised by the e2e tests."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest
from websockets.asyncio.server import serve

from agents import protocol as p
from agents.daemon import Daemon
from agents.daemon_config import build_config
from agents.spool import TransientError

from .helpers import kill_quietly, pid_alive, wait_until

KEY = "chk_test_secret"


class StandInPortal:
    def __init__(self):
        self.connections = []          # live server-side connections
        self.hellos: list[dict] = []
        self.messages: list[dict] = []
        self.auth_headers: list[str] = []
        self.reports: list[tuple[str, dict]] = []
        self.down = False
        self.server = None

    # -- WebSocket
    async def handler(self, ws):
        self.auth_headers.append(ws.request.headers.get("Authorization"))
        if ws.request.headers.get("Authorization") != f"Bearer {KEY}":
            await ws.close(4401)
            return
        self.connections.append(ws)
        await ws.send(json.dumps({"type": p.WELCOME, "connection": "conn-1", "heartbeat_interval_s": 5,
                                  "heartbeat_timeout_s": 20}))
        try:
            async for raw in ws:
                message = json.loads(raw)
                self.messages.append(message)
                if message["type"] == p.HELLO:
                    self.hellos.append(message)
        except Exception:  # noqa: BLE001
            pass
        finally:
            self.connections.remove(ws)

    async def start(self):
        self.server = await serve(self.handler, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self):
        self.server.close()
        await self.server.wait_closed()

    async def command(self, action, turn=None, payload=None, command_id=None):
        command = {"type": p.COMMAND, "id": command_id or str(uuid.uuid4()), "action": action, "turn": turn,
                   "payload": payload or {}}
        await wait_until(lambda: self.connections)
        await self.connections[-1].send(json.dumps(command))
        return command["id"]

    def of_type(self, kind):
        return [m for m in self.messages if m["type"] == kind]

    # -- HTTP reports
    async def post(self, path, body):
        await asyncio.sleep(0)
        if self.down:
            raise TransientError("portal down")
        self.reports.append((path, body))
        return 200, "{}"

    def advances(self, turn):
        return [b for path, b in self.reports if path == f"/daemon/turns/{turn}/advance"]

    def statuses(self, turn):
        return [b.get("status") for b in self.advances(turn) if b.get("status")]


@pytest.fixture
async def portal():
    stand_in = StandInPortal()
    stand_in.url = await stand_in.start()
    yield stand_in
    await stand_in.stop()


@pytest.fixture
def workdir(tmp_path):
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
async def make_daemon(portal, workdir, tmp_path):
    started = []

    async def factory(**overrides):
        settings = {"portal": portal.url, "key": KEY, "cwds": [str(workdir)], "sigint_timeout_s": 1.0,
                    "spool_dir": str(tmp_path / "spool"), **overrides}
        config = build_config(settings, {}, {})
        daemon = Daemon(config, poster=portal.post, install_signals=False,
                        environ={**os.environ, "CHORUS_SCRIPTED_HOME": str(tmp_path / "scripted")})
        task = asyncio.create_task(daemon.run())
        started.append((daemon, task))
        await wait_until(lambda: daemon.connected.is_set() or task.done())
        return daemon, task

    yield factory
    for daemon, task in started:
        if not task.done():
            daemon.request_shutdown()
            await asyncio.wait_for(task, 30)


def start_payload(workdir, prompt, session="s-1"):
    return {"session": session, "cwd": str(workdir), "prompt": prompt, "backend": "scripted",
            "backend_session_id": None, "trigger": "human_instruction", "env": {}, "timeout_s": None}


async def test_hello_snapshot_ack_and_a_turn(portal, make_daemon, workdir):
    daemon, _ = await make_daemon()
    await wait_until(lambda: portal.hellos and portal.of_type(p.SNAPSHOT))
    hello = portal.hellos[0]
    assert portal.auth_headers[0] == f"Bearer {KEY}"
    assert hello["backends"] == ["scripted"] and hello["cwds"] == [str(workdir.resolve())]
    assert hello["max_concurrency"] == 4 and hello["sigint_timeout_s"] == 1.0 and hello["version"]
    assert portal.of_type(p.SNAPSHOT)[0]["running"] == []

    command_id = await portal.command(p.START_TURN, "turn-a", start_payload(workdir, "@sleep 0.5\n@reply done"))
    await wait_until(lambda: any(m.get("command") == command_id for m in portal.of_type(p.ACK)))
    await wait_until(lambda: "ended" in portal.statuses("turn-a"))
    assert portal.statuses("turn-a") == ["running", "ended"]
    running_snapshots = [s["running"] for s in portal.of_type(p.SNAPSHOT) if s["running"]]
    assert running_snapshots and running_snapshots[0][0]["turn"] == "turn-a"
    assert set(running_snapshots[0][0]) == {"turn", "session", "pid", "pgid", "started_at", "process_start_time"}
    await wait_until(lambda: portal.of_type(p.SNAPSHOT)[-1]["running"] == [])
    assert portal.advances("turn-a")[-1]["final_reply"] == "done"


async def test_duplicate_commands_are_acked_again_but_acted_on_once(portal, make_daemon, workdir):
    await make_daemon()
    payload = start_payload(workdir, "@reply once")
    for _ in range(3):
        await portal.command(p.START_TURN, "turn-dup", payload, command_id="cmd-dup")
    await wait_until(lambda: len([m for m in portal.of_type(p.ACK) if m["command"] == "cmd-dup"]) == 3)
    await wait_until(lambda: "ended" in portal.statuses("turn-dup"))
    # a second start command for the same turn (another id) is acked and ignored too
    await portal.command(p.START_TURN, "turn-dup", payload, command_id="cmd-other")
    await wait_until(lambda: any(m["command"] == "cmd-other" for m in portal.of_type(p.ACK)))
    await portal.command(p.PROBE, "turn-dup", command_id="probe-after")
    await wait_until(lambda: any(m.get("command") == "probe-after" for m in portal.of_type(p.RESULT)))
    assert portal.statuses("turn-dup") == ["running", "ended"]


async def test_probe_and_interrupt(portal, make_daemon, workdir):
    daemon, _ = await make_daemon()
    await portal.command(p.START_TURN, "turn-p", start_payload(workdir, "@ignore-stop\n@grandchild 60\n@sleep 60"))
    await wait_until(lambda: daemon.holds("turn-p"))
    runner = daemon.runners["turn-p"]
    pid = runner.agent.pid
    # the agent is deaf to SIGINT only once it has said so (and started its grandchild)
    await wait_until(lambda: any("grandchild_pid" in e.data for e in runner._recent))
    await portal.command(p.PROBE, "turn-p", command_id="probe-1")
    await portal.command(p.PROBE, "turn-unknown", command_id="probe-2")
    await wait_until(lambda: len(portal.of_type(p.RESULT)) == 2)
    results = {m["command"]: m["result"] for m in portal.of_type(p.RESULT)}
    assert results == {"probe-1": {"held": True}, "probe-2": {"held": False}}
    # a repeated probe is answered again (the first answer may have been lost)
    await portal.command(p.PROBE, "turn-p", command_id="probe-1")
    await wait_until(lambda: len(portal.of_type(p.RESULT)) == 3)

    await portal.command(p.INTERRUPT, "turn-p", {"sigint_timeout_s": 0.5})
    await wait_until(lambda: "interrupted" in portal.statuses("turn-p"), 15)
    advances = portal.advances("turn-p")
    assert [a.get("stop_state") for a in advances if "status" not in a] == ["signalled", "escalated"]
    assert advances[-1]["reason"] == "user" and advances[-1]["stop_state"] == "confirmed"
    assert not pid_alive(pid)


async def test_interrupt_of_a_turn_never_held_here_is_answered_not_held_and_not_reported(portal, make_daemon):
    # A daemon reports only turns it holds (issue 7 item 9): the turn may run on another daemon,
    # e.g. of the connection its session moved away from; the portal decides with "not held".
    daemon, _ = await make_daemon()
    await portal.command(p.INTERRUPT, "turn-elsewhere", {"sigint_timeout_s": 5}, command_id="int-1")
    await wait_until(lambda: any(m.get("command") == "int-1" for m in portal.of_type(p.RESULT)))
    assert [m["result"] for m in portal.of_type(p.RESULT) if m["command"] == "int-1"] == [{"held": False}]
    await daemon.sender.drain(2)
    assert portal.advances("turn-elsewhere") == []


async def test_interrupt_of_a_turn_that_exited_here_is_reported_after_its_end(portal, make_daemon, workdir):
    daemon, _ = await make_daemon()
    await portal.command(p.START_TURN, "turn-done", start_payload(workdir, "@reply hi"))
    await wait_until(lambda: "ended" in portal.statuses("turn-done") and "turn-done" in daemon.finished, 15)
    await portal.command(p.INTERRUPT, "turn-done", {"sigint_timeout_s": 5})
    await wait_until(lambda: portal.statuses("turn-done")[-1:] == ["interrupted"])
    assert portal.statuses("turn-done")[-2:] == ["ended", "interrupted"]  # the portal refuses the latter


async def test_interrupt_of_an_exited_turn_stops_what_it_left_running_before_confirming(portal, make_daemon, workdir):
    """An agent that exited leaving a process behind (a dev server, say) and then is interrupted:
    'confirmed' means no process of the turn lives (SPEC §4.1), so the leftover is stopped first."""
    daemon, _ = await make_daemon()
    await portal.command(p.START_TURN, "turn-left", start_payload(workdir, "@background 60\n@reply started it"))
    await wait_until(lambda: "ended" in portal.statuses("turn-left") and "turn-left" in daemon.finished, 15)
    ended = [a for a in portal.advances("turn-left") if a["status"] == "ended"][0]
    leftover = ended["background_processes"][0]["pid"]
    try:
        assert pid_alive(leftover)
        await portal.command(p.INTERRUPT, "turn-left", {"sigint_timeout_s": 2})
        await wait_until(lambda: portal.statuses("turn-left")[-1:] == ["interrupted"], 15)
        stop = portal.advances("turn-left")[-1]
        assert stop["stop_state"] == "confirmed"
        assert not pid_alive(leftover), "confirmed while the turn's leftover process lives"
    finally:
        kill_quietly(leftover)


async def test_capacity_and_one_turn_per_session(portal, make_daemon, workdir):
    daemon, _ = await make_daemon(max_concurrency=2)
    await portal.command(p.START_TURN, "s1-a", start_payload(workdir, "@sleep 1\n@reply a", session="s1"))
    await portal.command(p.START_TURN, "s1-b", start_payload(workdir, "@reply b", session="s1"))
    await portal.command(p.START_TURN, "s2-a", start_payload(workdir, "@sleep 1\n@reply c", session="s2"))
    await portal.command(p.START_TURN, "s3-a", start_payload(workdir, "@reply d", session="s3"))
    await wait_until(lambda: daemon.holds("s1-a") and daemon.holds("s2-a"))
    assert [r.turn for r in daemon.queue] == ["s1-b", "s3-a"]    # session busy; capacity full
    assert not portal.advances("s1-b") and not portal.advances("s3-a")
    await wait_until(lambda: all("ended" in portal.statuses(t) for t in ("s1-a", "s1-b", "s2-a", "s3-a")), 20)
    # every snapshot of the running set respects both limits
    running_sets = [{t["turn"] for t in snap["running"]} for snap in portal.of_type(p.SNAPSHOT)]
    assert max(len(r) for r in running_sets) == 2
    assert not [r for r in running_sets if {"s1-a", "s1-b"} <= r]
    assert daemon.finished.keys() >= {"s1-a", "s1-b", "s2-a", "s3-a"}


async def test_interrupt_of_a_queued_turn(portal, make_daemon, workdir):
    daemon, _ = await make_daemon(max_concurrency=1)
    await portal.command(p.START_TURN, "busy", start_payload(workdir, "@sleep 60", session="x"))
    await portal.command(p.START_TURN, "queued", start_payload(workdir, "@write q.txt no", session="y"))
    await wait_until(lambda: daemon.holds("busy") and [r.turn for r in daemon.queue] == ["queued"])
    await portal.command(p.INTERRUPT, "queued", {"sigint_timeout_s": 1})
    await wait_until(lambda: portal.advances("queued"))
    assert portal.advances("queued") == [{"report_id": portal.advances("queued")[0]["report_id"],
                                          "status": "interrupted", "reason": "user", "stop_state": "confirmed"}]
    assert not (workdir / "q.txt").exists() and daemon.holds("busy")


async def test_reconnects_while_the_agent_keeps_running(portal, make_daemon, workdir):
    daemon, _ = await make_daemon()
    await portal.command(p.START_TURN, "turn-r", start_payload(workdir, "@sleep 1.5\n@reply survived"))
    await wait_until(lambda: daemon.holds("turn-r"))
    pid = daemon.runners["turn-r"].agent.pid
    await portal.connections[-1].close()               # the network drops
    await wait_until(lambda: len(portal.hellos) == 2, 15)
    assert pid_alive(pid) or "ended" in portal.statuses("turn-r")
    # the new connection starts with a snapshot that still lists the running turn (or it ended meanwhile)
    await wait_until(lambda: "ended" in portal.statuses("turn-r"), 15)
    assert portal.advances("turn-r")[-1]["final_reply"] == "survived"


async def test_reports_made_while_the_portal_is_down_arrive_once_it_is_back(portal, make_daemon, workdir):
    portal.down = True
    daemon, _ = await make_daemon()
    await portal.command(p.START_TURN, "turn-d", start_payload(workdir, "@reply later"))
    await wait_until(lambda: "turn-d" in daemon.finished, 15)
    # running, output, ended: the spool writes off the event loop, so the last may land a moment
    # after the turn is finished (under load it did: 2 of 3 on disk at that instant)
    await wait_until(lambda: daemon.spool.count() >= 3, 15)
    assert not portal.reports
    portal.down = False
    daemon.sender.kick()
    await wait_until(lambda: "ended" in portal.statuses("turn-d"), 15)
    ids = [b["report_id"] for _, b in portal.reports]
    assert len(ids) == len(set(ids))
    assert portal.statuses("turn-d") == ["running", "ended"]
    await wait_until(lambda: daemon.spool.count() == 0)


async def test_shutdown_interrupts_running_and_queued_turns(portal, make_daemon, workdir):
    daemon, task = await make_daemon(max_concurrency=1)
    await portal.command(p.START_TURN, "run-1", start_payload(workdir, "@ignore-stop\n@sleep 60", session="a"))
    await portal.command(p.START_TURN, "wait-1", start_payload(workdir, "@reply never", session="b"))
    await wait_until(lambda: daemon.holds("run-1") and daemon.queue)
    pid = daemon.runners["run-1"].agent.pid
    daemon.request_shutdown()
    await asyncio.wait_for(task, 20)
    assert portal.advances("run-1")[-1]["status"] == "interrupted"
    assert portal.advances("run-1")[-1]["reason"] == "shutdown"
    assert portal.advances("wait-1") and portal.advances("wait-1")[-1]["reason"] == "shutdown"
    assert not pid_alive(pid)
    # commands arriving during shutdown are not acked (the portal replays them later)
    assert daemon.spool.count() == 0


async def test_a_wrong_key_keeps_retrying(portal, workdir, tmp_path):
    config = build_config({"portal": portal.url, "key": "chk_wrong_key", "cwds": [str(workdir)],
                           "spool_dir": str(tmp_path / "spool")}, {}, {})
    daemon = Daemon(config, poster=portal.post, install_signals=False)
    task = asyncio.create_task(daemon.run())
    await wait_until(lambda: len(portal.auth_headers) >= 2, 10)
    assert not portal.hellos
    daemon.request_shutdown()
    await asyncio.wait_for(task, 10)


async def test_spooled_reports_of_an_earlier_run_go_first(portal, make_daemon, workdir, tmp_path):
    from agents.spool import Spool

    spool = Spool(str(tmp_path / "spool"))
    spool.put(lane="old-turn", path="/daemon/turns/old-turn/advance",
              body={"report_id": "left-over", "status": "ended"})
    spool.close()
    await make_daemon()
    await wait_until(lambda: portal.advances("old-turn"))
    assert portal.reports[0][1]["report_id"] == "left-over"


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    # nothing a test started may outlive it
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if "scripted_agent" in " ".join(child.cmdline()) or "time.sleep" in " ".join(child.cmdline()):
                kill_quietly(child.pid)
        except psutil.Error:
            pass
