"""P3 (SPEC §11): daemon event ingestion, committed and fanned out, beside a raw COPY of the same rows.

Target: ≥ 5,000 events/s through the real report route (``POST /api/v1/daemon/turns/{id}/events``,
authenticated by the connection key, idempotent, redacted, one INSERT and one broadcast per report)
on this machine; the ratio to ``COPY`` of the same rows into the event table is reported.

The script makes a database of its own (dropped, created, migrated, dropped again), starts one
portal process (daphne, and uvicorn when installed: ``pip install -e .[bench]``) on loopback, and
registers a daemon connection with ``--lanes`` running turns.  Each lane is one thread posting
reports of ``--batch`` events one after another, as the daemon's spool does per turn.  One SSE
follower (``/api/v1/sessions/{id}/events/stream``) watches lane 0's session: "fanned out" means it
received every event of that lane.  Raw floors, same run and database: one ``COPY`` of all rows,
and one ``COPY`` + ``COMMIT`` per batch.

    .venv/bin/python bench/p3_ingest.py                        # 20,000 events per server, ~1 min
    .venv/bin/python bench/p3_ingest.py --events 5000 --no-docs
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import shlex
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from portal_stack import (DEFAULT_REDIS_URL, Portal, Unmeasurable, cpu_seconds, docs_write, environment, http_json,
                          log, online_connection, operator_with_token, prepare_database, server_available, stats_ms,
                          versions)

TARGET_EVENTS_PER_S = 5000
SECTION = "P3 event ingestion"


def agent_lines(count: int, offset: int = 0) -> list[dict]:
    """What a busy agent prints: code, paths, test output (the redaction rules do real work on it)."""
    shapes = ("[{n:06d}] compiling chorus_site/live_{m}.py: 12 functions, 3 classes, ok",
              "PASSED tests/streams/test_fanout.py::test_case_{m} in 0.{m:02d}s",
              "Reading file /work/project/src/module_{m}/handlers.py (2,{m:03d} bytes)",
              "diff --git a/src/app_{m}.ts b/src/app_{m}.ts  @@ -10,7 +10,8 @@ export function handler{m}()")
    return [{"kind": "text", "data": {"text": shapes[(offset + i) % 4].format(n=offset + i, m=(offset + i) % 97)}}
            for i in range(count)]


class SseWatcher(threading.Thread):
    """Follows one session's SSE stream and counts the events it receives."""

    def __init__(self, port: int, session_id: str, token: str):
        super().__init__(daemon=True)
        self.port, self.session_id, self.token = port, session_id, token
        self.received = 0
        self.last_at = 0.0
        self.ready = threading.Event()
        self.error: str | None = None

    def run(self):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            conn.request("GET", f"/api/v1/sessions/{self.session_id}/events/stream",
                         headers={"Authorization": f"Bearer {self.token}", "Accept": "text/event-stream"})
            response = conn.getresponse()
            if response.status != 200:
                self.error = f"SSE answered {response.status}"
                return
            self.ready.set()
            for raw in response:
                if raw.startswith(b"data: "):
                    message = json.loads(raw[6:])
                    if message.get("kind") == "turn.output":
                        self.received += 1
                        self.last_at = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 — reported as the figure's error
            if not self.error:
                self.error = f"{exc.__class__.__name__}: {exc}"
        finally:
            self.ready.set()


def start_turns(url: str, token: str, connection, key: str, cwd: str, lanes: int) -> list[dict]:
    turns = []
    for _ in range(lanes):
        status, body = http_json("POST", url + "/api/v1/sessions", {
            "connection": str(connection.pk), "cwd": cwd, "prompt": "@reply bench"}, token)
        if status != 201:
            raise Unmeasurable(f"POST /sessions answered {status}: {body}")
        status, answer = http_json("POST", f"{url}/api/v1/daemon/turns/{body['turn']}/advance",
                                   {"report_id": str(uuid.uuid4()), "status": "running", "pid": 4242}, key)
        if status != 200:
            raise Unmeasurable(f"advance running answered {status}: {answer}")
        turns.append({"turn": body["turn"], "session": body["session"]})
    return turns


def run_lanes(url: str, key: str, turns: list[dict], events: int, batch: int) -> dict:
    per_lane = events // len(turns)
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def lane(index: int, turn: str):
        offset = 0
        while offset < per_lane:
            count = min(batch, per_lane - offset)
            body = {"report_id": str(uuid.uuid4()), "events": agent_lines(count, offset + index * per_lane)}
            t0 = time.perf_counter()
            status, answer = http_json("POST", f"{url}/api/v1/daemon/turns/{turn}/events", body, key, timeout=120)
            elapsed = time.perf_counter() - t0
            with lock:
                latencies.append(elapsed)
                if status != 200 or answer.get("accepted") != count:
                    errors.append(f"{status}: {str(answer)[:200]}")
            offset += count

    threads = [threading.Thread(target=lane, args=(i, t["turn"])) for i, t in enumerate(turns)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - t0
    return {"events": per_lane * len(turns), "seconds": round(elapsed, 3), "started": t0,
            "events_per_s": round(per_lane * len(turns) / elapsed, 1), "report": stats_ms(latencies),
            "reports": len(latencies), "errors": errors[:5], "error_count": len(errors)}


def copy_floor(events: int, batch: int) -> dict:
    """The same rows straight into the event table with COPY: all at once, and one commit per batch."""
    from django.db import connection
    from django.utils import timezone

    from chorus_site.models import Event

    table = Event._meta.db_table
    now = timezone.now().isoformat()
    turn = str(uuid.uuid4())
    rows = [json.dumps({"id": turn, "type": e["kind"], "data": e["data"]}) for e in agent_lines(events)]
    out = {}
    connection.ensure_connection()
    raw = connection.connection
    for label, per_batch in (("copy_one_transaction", False), ("copy_commit_per_batch", True)):
        stream = f"session:{uuid.uuid4()}"
        t0 = time.perf_counter()
        seq = 0
        for start in range(0, events, batch if per_batch else events):
            chunk = rows[start:start + (batch if per_batch else events)]
            with raw.cursor() as cursor:
                with cursor.copy(f"COPY {table} (stream, seq, kind, data, actor, at) FROM STDIN") as copy:
                    for data in chunk:
                        seq += 1
                        copy.write_row((stream, seq, "turn.output", data, "", now))
            raw.commit()
        elapsed = time.perf_counter() - t0
        out[label] = {"rows": events, "seconds": round(elapsed, 3), "rows_per_s": round(events / elapsed, 1)}
    return out


def start_profile(pid: int, out: Path):
    """py-spy (pip install py-spy) on the portal while it is measured: collapsed stacks to ``out``."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                             "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def stop_profile(process, out: Path, top: int = 15) -> dict:
    """Share of samples per function (inclusive), the top ``top``; the file stays in the temp dir."""
    import signal as signals

    process.send_signal(signals.SIGINT)
    process.wait(timeout=30)
    inclusive: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines() if out.exists() else []:
        stack, _, count = line.rpartition(" ")
        total += int(count)
        for frame in set(stack.split(";")):
            inclusive[frame] = inclusive.get(frame, 0) + int(count)
    ranked = sorted(inclusive.items(), key=lambda item: -item[1])[:top]
    return {"samples": total, "file": str(out),
            "top_inclusive": [{"frame": frame[:160], "share": round(n / total, 3)} for frame, n in ranked] if total else []}


def measure_server(server: str, args, tmp: Path, env: dict, token: str) -> dict:
    from sessions_app.models import Connection

    cwd = str(tmp / "work")
    connection, key = online_connection(f"bench-p3-{server}", cwd)
    portal = Portal(server, env, tmp).start()
    try:
        turns = start_turns(portal.url, token, connection, key, cwd + "/app", args.lanes)
        watcher = SseWatcher(portal.port, turns[0]["session"], token)
        watcher.start()
        watcher.ready.wait(30)
        run_lanes(portal.url, key, turns, args.lanes * args.batch * 3, args.batch)  # warm-up, not measured
        time.sleep(0.5)
        watcher_before = watcher.received
        cpu0 = cpu_seconds(portal.pid())
        profiler = start_profile(portal.pid(), tmp / f"{server}.pyspy.txt") if args.profile else None
        result = run_lanes(portal.url, key, turns, args.events, args.batch)
        cpu = cpu_seconds(portal.pid()) - cpu0
        if profiler is not None:
            result["profile"] = stop_profile(profiler, tmp / f"{server}.pyspy.txt")
        lane_events = result["events"] // args.lanes
        deadline = time.monotonic() + 60
        while watcher.received - watcher_before < lane_events and time.monotonic() < deadline and not watcher.error:
            time.sleep(0.02)
        seen = watcher.received - watcher_before
        result.update({
            "server": server, "lanes": args.lanes, "batch": args.batch,
            "portal_cpu_s": round(cpu, 2), "portal_cpu_ms_per_event": round(cpu * 1000 / result["events"], 3),
            "sse_follower": {"expected": lane_events, "received": seen, "error": watcher.error,
                             "all_seen_after_s": round(watcher.last_at - result["started"], 3) if seen else None},
        })
        result.pop("started")
        Connection.objects.filter(pk=connection.pk).update(status="offline")
        return result
    finally:
        portal.stop()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=20000, help="measured events per server (default 20,000)")
    p.add_argument("--batch", type=int, default=100, help="events per report (the daemon's batch; default 100)")
    p.add_argument("--lanes", type=int, default=4, help="turns reporting at once (default 4)")
    p.add_argument("--servers", default="daphne,uvicorn", help="daphne,uvicorn (uvicorn skipped if not installed)")
    p.add_argument("--database-url", default="postgres://root@127.0.0.1:5432/chorus_bench_p3")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    p.add_argument("--profile", action="store_true", help="py-spy the portal while measured (top frames in the JSON)")
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = ".venv/bin/python bench/p3_ingest.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv) if a != "--no-docs")
    tmp = Path(tempfile.mkdtemp(prefix="chorus-bench-p3-"))
    (tmp / "work" / "app").mkdir(parents=True)
    doc = {"target": "P3", "date": dt.date.today().isoformat(), "command": command,
           "load_average_start": round(os.getloadavg()[0], 2)}
    log(f"bench database {args.database_url}; logs in {tmp}")
    prepare_database(args.database_url, args.redis_url)
    from benchdb import database_recreate

    try:
        doc["versions"] = versions()
        _user, token = operator_with_token("bench-p3")
        env = environment(args.database_url, args.redis_url, tmp)
        doc["servers"] = []
        for server in [s.strip() for s in args.servers.split(",") if s.strip()]:
            if not server_available(server):
                doc["servers"].append({"server": server, "skipped": "not installed (pip install -e .[bench])"})
                continue
            log(f"{server}: {args.events} events in reports of {args.batch} over {args.lanes} lanes")
            doc["servers"].append(measure_server(server, args, tmp, env, token))
        log("raw floor: COPY of the same rows")
        doc["raw_floor"] = copy_floor(args.events, args.batch)
        floor = doc["raw_floor"]["copy_one_transaction"]["rows_per_s"]
        for result in doc["servers"]:
            if "events_per_s" in result:
                result["ratio_to_copy"] = round(floor / result["events_per_s"], 2)
                result["met"] = (result["events_per_s"] >= TARGET_EVENTS_PER_S and not result["error_count"]
                                 and result["sse_follower"]["received"] == result["sse_follower"]["expected"])
        doc["load_average_end"] = round(os.getloadavg()[0], 2)
    finally:
        from django.db import connections

        connections.close_all()
        database_recreate(args.database_url, drop_only=True)
    print(json.dumps(doc, indent=2))
    if not args.no_docs:
        docs_write(SECTION, docs_section(doc))
    return 0


def docs_section(doc: dict) -> str:
    v = doc["versions"]
    rows = []
    for r in doc["servers"]:
        if "skipped" in r:
            rows.append(f"| {r['server']} | skipped: {r['skipped']} | | | | | |")
            continue
        sse = r["sse_follower"]
        rows.append(f"| {r['server']} | **{r['events_per_s']:,.0f}** | {r['report']['p50_ms']} / {r['report']['p99_ms']} | "
                    f"{r['portal_cpu_ms_per_event']} | {sse['received']}/{sse['expected']} | ×{r['ratio_to_copy']} | "
                    f"{'yes' if r['met'] else 'no'} |")
    floor = doc["raw_floor"]
    return "\n".join([
        f"Target (SPEC §11 P3): ≥ {TARGET_EVENTS_PER_S:,} events/s through the real report route, committed and "
        "fanned out; ratio to a raw COPY of the same rows.",
        "",
        f"Measured {doc['date']} on {v['cores']} cores shared with other work (load average {doc['load_average_start']} "
        f"at the start, {doc['load_average_end']} at the end: absolute figures are inflated, the ratio to the raw "
        f"floor of the same run is the point); Python {v['python']}, Django {v['django']}, channels {v['channels']}, "
        f"channels_redis {v['channels_redis']}, daphne {v['daphne']}, uvicorn {v['uvicorn']}; code at {v['commit']}. "
        "Command:",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"{doc['servers'][0].get('lanes', '')} turns report at once, each report {doc['servers'][0].get('batch', '')} "
        "events of agent-like text (paths, test lines, diffs: the redaction rules run on real-looking text); every "
        "report is authenticated, idempotent, redacted, one INSERT of its rows, one sequence allocation and one "
        "channel-layer message after commit. \"Fanned out\": an SSE follower of one turn's session received "
        "every event of it.",
        "",
        "| server | events/s | report p50 / p99 (ms) | portal CPU ms/event | SSE follower | gap to COPY | met |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Raw floor, same run and database: COPY of the same rows in one transaction "
        f"{floor['copy_one_transaction']['rows_per_s']:,.0f} rows/s; COPY + COMMIT per batch "
        f"{floor['copy_commit_per_batch']['rows_per_s']:,.0f} rows/s.",
    ])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Unmeasurable as exc:
        log(f"cannot measure: {exc}")
        sys.exit(2)
