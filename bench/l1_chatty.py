"""L1 (SPEC §11): N chatty agents over M daemons on one portal process.

Target: 0 false offlines; a turn shows ``ended`` ≤ 2 s after its agent exits; stop confirmations
within P2 (a cooperative agent's stop confirmed ≤ sigint timeout + 1 s) while output floods.

The script makes a database of its own (dropped, created, migrated, dropped again), starts one
daphne portal and ``--daemons`` real daemons (``manage.py chorus_daemon --backend scripted``, each
with its own spool and connection), and starts ``--agents`` chatty turns spread over them: each
scripted agent prints ``--lines`` JSON text events as fast as it can (``@cat``).  Besides them,
``--sleepers`` turns per run sleep; once the flood is under way each is interrupted through the
API.  Meanwhile this process runs the real stale sweep (``bridge.connections_sweep_stale``, as
Celery beat does) every 2 s and samples every 100–250 ms: each daemon's spool (files on disk),
each connection's heartbeat age, and the agents' pids (from the turns' ``running`` reports).

Measured: agent exit → the turn's ``ended`` committed (the ``turn.status`` event's time), and →
all its output stored; spool peak; heartbeat age max; false offlines (connections marked offline,
turns settled ``interrupted(offline)``: must be 0); API interrupt → stop confirmed.

    .venv/bin/python bench/l1_chatty.py                                  # 10 agents over 2 daemons
    .venv/bin/python bench/l1_chatty.py --agents 50 --daemons 5 --lines 300
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from portal_stack import (DEFAULT_REDIS_URL, ROOT, Portal, Unmeasurable, docs_write, environment, http_json, log,
                          operator_with_token, percentile, prepare_database, stop_process, versions, wait_until)

SECTION = "L1 chatty agents"
ENDED_TARGET_S = 2.0
SWEEP_EVERY_S = 2.0


def flood_file(path: Path, lines: int) -> None:
    with path.open("w") as fh:
        for n in range(lines):
            fh.write(json.dumps({"type": "text", "text": f"[{n:06d}] building src/module_{n % 97}/part_{n % 13}.py ... "
                                                          f"ok ({n % 1000} ms), 3 warnings"}) + "\n")


def proc_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in {"Z", "X"}


class Daemons:
    def __init__(self, tmp: Path, portal_url: str, workspace: Path, count: int, per_daemon: int, sigint_timeout: int):
        from sessions_app.services import connection_register

        self.processes, self.connections, self.spools = [], [], []
        for i in range(count):
            connection, key = connection_register(name=f"bench-l1-{i}", backend="scripted", cwds=[str(workspace)],
                                                  max_concurrency=per_daemon, sigint_timeout_s=sigint_timeout)
            spool = tmp / f"spool-{i}"
            env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
            env.update(CHORUS_SCRIPTED_HOME=str(tmp / f"scripted-home-{i}"), CHORUS_DATA_DIR=str(tmp / f"daemon-{i}"))
            log_file = open(tmp / f"daemon-{i}.log", "w")
            self.processes.append(subprocess.Popen([
                sys.executable, "manage.py", "chorus_daemon", "--portal", portal_url, "--key", key,
                "--cwd", str(workspace), "--backend", "scripted", "--max-concurrency", str(per_daemon),
                "--sigint-timeout", str(sigint_timeout), "--spool-dir", str(spool)],
                cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))
            log_file.close()
            self.connections.append(connection)
            self.spools.append(spool)

    def wait_online(self):
        from sessions_app.models import Connection

        ids = [c.pk for c in self.connections]
        wait_until(lambda: Connection.objects.filter(pk__in=ids, status="online", daemon_socket__gt="").count() == len(ids),
                   timeout=90, message="the daemons to come online", interval=0.2)

    def spooled(self) -> list[int]:
        return [sum(1 for n in os.listdir(s) if n.endswith(".json")) if s.exists() else 0 for s in self.spools]

    def stop(self):
        for process in self.processes:
            stop_process(process)


class Sampler(threading.Thread):
    """Spool files, heartbeat ages, agent exits; and the stale sweep every SWEEP_EVERY_S."""

    def __init__(self, daemons: Daemons, turns: list[str]):
        super().__init__(daemon=True)
        self.daemons, self.turns = daemons, turns
        self.spool_peak = [0] * len(daemons.spools)
        self.heartbeat_age_max = 0.0
        self.exits: dict[str, float] = {}
        self.pids: dict[str, int] = {}
        self.sweeps: list[dict] = []
        self.stopping = threading.Event()

    def run(self):
        from django.db import connection as db
        from django.utils import timezone

        from sessions_app import bridge
        from sessions_app.models import Connection, Turn

        ids = [c.pk for c in self.daemons.connections]
        next_sweep = next_db = 0.0
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                for i, count in enumerate(self.daemons.spooled()):
                    self.spool_peak[i] = max(self.spool_peak[i], count)
                for turn, pid in list(self.pids.items()):
                    if turn not in self.exits and proc_gone(pid):
                        self.exits[turn] = time.time()
                if now >= next_db:
                    next_db = now + 0.25
                    wall = timezone.now()
                    for beat in Connection.objects.filter(pk__in=ids).values_list("last_heartbeat_at", flat=True):
                        if beat is not None:
                            self.heartbeat_age_max = max(self.heartbeat_age_max, (wall - beat).total_seconds())
                    missing = [t for t in list(self.turns) if t not in self.pids]
                    if missing:
                        for turn, pid in Turn.objects.filter(pk__in=missing, pid__isnull=False).values_list("pk", "pid"):
                            self.pids[str(turn)] = pid
                if now >= next_sweep:
                    next_sweep = now + SWEEP_EVERY_S
                    result = bridge.connections_sweep_stale()
                    if any(v for k, v in result.items() if isinstance(v, int)):
                        self.sweeps.append(result)
                time.sleep(0.01)
        finally:
            db.close()


def run(args, tmp: Path) -> dict:
    from django.db.models import Max

    from chorus_site.models import Event
    from sessions_app.models import Turn

    workspace = tmp / "work"
    workspace.mkdir()
    flood_file(workspace / "flood.jsonl", args.lines)
    env = environment(args.database_url, args.redis_url, tmp)
    _user, token = operator_with_token("bench-l1")
    portal = Portal("daphne", env, tmp).start()
    per_daemon = -(-(args.agents + args.sleepers) // args.daemons) + 1
    daemons = Daemons(tmp, portal.url, workspace, args.daemons, per_daemon, args.sigint_timeout)
    try:
        daemons.wait_online()
        log(f"{args.agents} chatty agents × {args.lines} lines and {args.sleepers} sleepers over {args.daemons} daemons")
        chatty, sleepers = [], []
        sampler = Sampler(daemons, chatty)  # sampling from the first start on (chatty grows below)
        sampler.start()
        for i in range(args.agents + args.sleepers):
            connection = daemons.connections[i % args.daemons]
            # The agent waits a moment first, so that its pid (from the running report) is known
            # here before it floods and exits: its exit is then seen when it happens.
            prompt = f"@sleep {args.lead_in}\n@cat flood.jsonl\ndone" if i < args.agents else "@sleep 300"
            status, body = http_json("POST", portal.url + "/api/v1/sessions", {
                "connection": str(connection.pk), "cwd": str(workspace), "prompt": prompt,
                "idea_key": f"bench-l1:{i}", "acknowledge_changes": True}, token)
            if status != 201:
                raise Unmeasurable(f"POST /sessions answered {status}: {body}")
            (chatty if i < args.agents else sleepers).append(body["turn"])
        expected = args.agents * args.lines
        streams = list(Turn.objects.filter(pk__in=chatty).values_list("session_id", flat=True))
        stored = Event.objects.filter(stream__in=[f"session:{s}" for s in streams], kind="turn.output")

        # Interrupt each sleeper once a fifth of the flood is stored (the daemons' spools are busy).
        wait_until(lambda: stored.count() >= expected // 5, timeout=args.timeout, message="the flood to start",
                   interval=0.2)
        stops = {}
        for turn in sleepers:
            t0 = time.time()
            status, answer = http_json("POST", f"{portal.url}/api/v1/turns/{turn}/interrupt",
                                       {"reason": "bench L1"}, token)
            stops[turn] = {"called_at": t0, "status": status}

        def settled():
            done = Turn.objects.filter(pk__in=chatty, status__in=["ended", "interrupted"]).count() == len(chatty)
            stopped = Turn.objects.filter(pk__in=sleepers, stop_state__in=["confirmed", "unconfirmed"]).count() \
                == len(sleepers)
            return done and stopped

        wait_until(settled, timeout=args.timeout, message="every turn to settle", interval=0.2)
        wait_until(lambda: stored.count() >= expected, timeout=args.timeout, message="all output to be stored",
                   interval=0.2)
        time.sleep(SWEEP_EVERY_S + 0.5)  # one more sweep over the quiet daemons
        sampler.stopping.set()
        sampler.join()
        ended_after, drained_after, statuses = [], [], {}
        for turn in Turn.objects.filter(pk__in=chatty):
            statuses[turn.status] = statuses.get(turn.status, 0) + 1
            exit_at = sampler.exits.get(str(turn.pk))
            status_event = Event.objects.filter(stream=turn.stream, kind="turn.status", data__id=str(turn.pk),
                                                data__status=turn.status).order_by("id").first()
            last_output = Event.objects.filter(stream=turn.stream, kind="turn.output", data__id=str(turn.pk)) \
                .aggregate(at=Max("at"))["at"]
            if exit_at and status_event:
                ended_after.append(status_event.at.timestamp() - exit_at)
            if exit_at and last_output:
                drained_after.append(last_output.timestamp() - exit_at)
        stop_latency = []
        for turn in Turn.objects.filter(pk__in=sleepers):
            confirmed = Event.objects.filter(stream=turn.stream, data__id=str(turn.pk),
                                             data__stop_state="confirmed").order_by("id").first()
            if confirmed:
                stop_latency.append(confirmed.at.timestamp() - stops[str(turn.pk)]["called_at"])
        offline_events = Event.objects.filter(stream__in=[f"connection:{c.pk}" for c in daemons.connections],
                                              kind="connection.status", data__status="offline").count()
        offline_turns = Turn.objects.filter(pk__in=chatty + sleepers, interrupted_reason="offline").count()
        return {
            "agents": args.agents, "daemons": args.daemons, "lines_per_agent": args.lines, "events": expected,
            "events_stored": stored.count(), "sleepers": args.sleepers, "turn_statuses": statuses,
            "ended_after_exit_s": _stats(ended_after), "output_stored_after_exit_s": _stats(drained_after),
            "exits_seen": len(sampler.exits), "spool_peak_files": sampler.spool_peak,
            "heartbeat_age_max_s": round(sampler.heartbeat_age_max, 2),
            "false_offlines": {"connections": offline_events, "turns": offline_turns, "sweeps_that_acted": sampler.sweeps},
            "stop_confirmed_after_s": _stats(stop_latency), "stops_confirmed": len(stop_latency),
            "sigint_timeout_s": args.sigint_timeout,
        }
    finally:
        daemons.stop()
        portal.stop()


def _stats(samples: list[float]) -> dict:
    return {"n": len(samples), "p50": _r(percentile(samples, 50)), "p99": _r(percentile(samples, 99)),
            "max": _r(max(samples) if samples else None)}


def _r(value):
    return None if value is None else round(value, 3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--daemons", type=int, default=2)
    p.add_argument("--lines", type=int, default=1000, help="events each chatty agent prints (default 1,000)")
    p.add_argument("--sleepers", type=int, default=2, help="turns interrupted under the flood (default 2)")
    p.add_argument("--sigint-timeout", type=int, default=2)
    p.add_argument("--lead-in", type=float, default=3.0, help="each chatty agent sleeps this long first (s)")
    p.add_argument("--timeout", type=float, default=240, help="give up after this long (s)")
    p.add_argument("--database-url", default="postgres://root@127.0.0.1:5432/chorus_bench_l1")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = ".venv/bin/python bench/l1_chatty.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv) if a != "--no-docs")
    tmp = Path(tempfile.mkdtemp(prefix="chorus-bench-l1-"))
    doc = {"target": "L1", "date": dt.date.today().isoformat(), "command": command,
           "load_average_start": round(os.getloadavg()[0], 2)}
    log(f"bench database {args.database_url}; logs in {tmp}")
    prepare_database(args.database_url, args.redis_url)
    from benchdb import database_recreate

    try:
        doc["versions"] = versions()
        doc["result"] = result = run(args, tmp)
        doc["load_average_end"] = round(os.getloadavg()[0], 2)
        ended = result["ended_after_exit_s"]
        stop = result["stop_confirmed_after_s"]
        doc["met"] = {
            "no_false_offline": result["false_offlines"]["connections"] == 0 and result["false_offlines"]["turns"] == 0,
            "ended_within_2s": ended["max"] is not None and ended["max"] <= ENDED_TARGET_S
            and ended["n"] == args.agents,
            "stops_within_p2": stop["n"] == args.sleepers and (stop["max"] or 0) <= args.sigint_timeout + 1,
        }
    finally:
        from django.db import connections

        connections.close_all()
        database_recreate(args.database_url, drop_only=True)
    print(json.dumps(doc, indent=2))
    if not args.no_docs:
        docs_write(SECTION, docs_section(doc))
    return 0


def docs_section(doc: dict) -> str:
    v, r, met = doc["versions"], doc["result"], doc["met"]
    e, d, s = r["ended_after_exit_s"], r["output_stored_after_exit_s"], r["stop_confirmed_after_s"]
    yes = lambda flag: "yes" if flag else "**no**"  # noqa: E731
    return "\n".join([
        "Target (SPEC §11 L1): N chatty agents (10, 50) over M daemons on one portal process: 0 false offlines; a "
        f"turn shows `ended` ≤ {ENDED_TARGET_S:g} s after its agent exits; stop confirmations within P2 while output "
        "floods.",
        "",
        f"Measured {doc['date']} on {v['cores']} cores shared with other work (load average {doc['load_average_start']} "
        f"at the start, {doc['load_average_end']} at the end; the daemons, their agents, the portal, PostgreSQL and "
        f"this script all share those cores); code at {v['commit']}. Command:",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"{r['agents']} agents × {r['lines_per_agent']} events over {r['daemons']} daemons ({r['events_stored']}/"
        f"{r['events']} events stored), {r['sleepers']} sleeping turns interrupted once a fifth of the flood was "
        "stored; the real stale sweep every 2 s.",
        "",
        "| measure | p50 | p99 | max | target met |",
        "|---|---|---|---|---|",
        f"| agent exit → `ended` committed (s) | {e['p50']} | {e['p99']} | {e['max']} | {yes(met['ended_within_2s'])} |",
        f"| agent exit → all its output stored (s) | {d['p50']} | {d['p99']} | {d['max']} | (no target) |",
        f"| API interrupt → stop confirmed (s), sigint timeout {r['sigint_timeout_s']} s | {s['p50']} | {s['p99']} | "
        f"{s['max']} | {yes(met['stops_within_p2'])} |",
        "",
        f"Spool peak (report files per daemon): {r['spool_peak_files']}; heartbeat age max {r['heartbeat_age_max_s']} s; "
        f"false offlines: {r['false_offlines']['connections']} connections, {r['false_offlines']['turns']} turns "
        f"({yes(met['no_false_offline'])}).",
    ])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Unmeasurable as exc:
        log(f"cannot measure: {exc}")
        sys.exit(2)
