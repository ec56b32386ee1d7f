"""P1 (SPEC §11): status commit → WebSocket client, 200 watchers, 20 changes/s.

Target: p50 ≤ 10 ms, p99 ≤ 50 ms, 100 % delivered; the ratio to a raw Redis pub/sub round trip to
the same number of subscribers, measured in the same run; daphne and uvicorn side by side.

The script makes a database of its own (dropped, created, migrated, dropped again) and, per
server, starts one portal process on loopback.  A child process (``--watchers-child``) opens the
watchers: ``/ws/live/`` WebSockets signed in as an operator (session cookie), each subscribed to
one session's stream — all on one session, then spread over 50 sessions.  This process then
commits status changes at ``--rate`` per second (``event_append`` of a ``turn.status`` event in
its own transaction, as a status change does) and records the time just before each COMMIT; the
child records when each watcher receives each event (same clock).  Raw floor, same run: one
Redis PUBLISH at the same rate to as many subscribers (redis-py asyncio in the child), publish →
receive.

    .venv/bin/python bench/p1_fanout.py                   # 10 s per scenario and server, ~2 min
    .venv/bin/python bench/p1_fanout.py --seconds 5 --servers daphne --no-docs
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from portal_stack import (DEFAULT_REDIS_URL, Portal, Unmeasurable, cpu_seconds, docs_write, environment, http_json,
                          log, online_connection, operator_with_token, prepare_database, server_available,
                          session_cookie, stats_ms, versions)

SECTION = "P1 live fan-out"
TARGET_P50_MS, TARGET_P99_MS = 10.0, 50.0


# ------------------------------------------------------------------------------ the watchers' process
async def _watch(url: str, cookie: str, origin: str, streams: list[str], ready_path: str, stop_path: str) -> dict:
    import websockets

    received: list[list[tuple[int, float]]] = [[] for _ in streams]

    async def one(index: int, stream: str, opened: asyncio.Event):
        async with websockets.connect(url, additional_headers={"Cookie": cookie, "Origin": origin},
                                      max_size=None, open_timeout=60, ping_interval=None) as ws:
            await ws.send(json.dumps({"type": "subscribe", "stream": stream}))
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "subscribed":
                    break
            opened.set()
            while True:
                raw = await ws.recv()
                at = time.time()
                frame = json.loads(raw)
                events = [frame["event"]] if frame["type"] == "event" else frame.get("events", [])
                for event in events:
                    if event["kind"] == "turn.status":
                        received[index].append((event["data"]["n"], at))

    tasks, opened = [], []
    for index, stream in enumerate(streams):
        flag = asyncio.Event()
        opened.append(flag)
        tasks.append(asyncio.ensure_future(one(index, stream, flag)))
        if index % 20 == 19:
            await asyncio.sleep(0.05)  # no thundering herd of handshakes
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in opened)), 120)
    Path(ready_path).write_text("ready")
    while not os.path.exists(stop_path):
        await asyncio.sleep(0.05)
        for task in tasks:
            if task.done() and task.exception():
                raise task.exception()
    for task in tasks:
        task.cancel()
    return {"received": received}


async def _pubsub(redis_url: str, subscribers: int, ready_path: str, stop_path: str) -> dict:
    import redis.asyncio as aioredis

    received: list[list[tuple[int, float]]] = [[] for _ in range(subscribers)]
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(subscribers)]
    pubsubs = [c.pubsub() for c in clients]
    for p in pubsubs:
        await p.subscribe("bench-p1-floor")

    async def listen(index, p):
        async for message in p.listen():
            if message["type"] == "message":
                received[index].append((int(message["data"]), time.time()))

    tasks = [asyncio.ensure_future(listen(i, p)) for i, p in enumerate(pubsubs)]
    Path(ready_path).write_text("ready")
    while not os.path.exists(stop_path):
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    for c in clients:
        await c.aclose()
    return {"received": received}


def watchers_child(spec: dict) -> None:
    if spec["mode"] == "websocket":
        result = asyncio.run(_watch(spec["url"], spec["cookie"], spec["origin"], spec["streams"], spec["ready"],
                                    spec["stop"]))
    else:
        result = asyncio.run(_pubsub(spec["redis_url"], spec["subscribers"], spec["ready"], spec["stop"]))
    Path(spec["out"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------ the driver
class Watchers:
    def __init__(self, tmp: Path, name: str, spec: dict):
        self.ready, self.stop, self.out = (tmp / f"{name}.{k}" for k in ("ready", "stop", "out"))
        for path in (self.ready, self.stop, self.out):
            path.unlink(missing_ok=True)
        spec = {**spec, "ready": str(self.ready), "stop": str(self.stop), "out": str(self.out)}
        self.log = open(tmp / f"{name}.log", "w")
        self.process = subprocess.Popen([sys.executable, __file__, "--watchers-child", json.dumps(spec)],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout=180):
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.flush()
                raise Unmeasurable(f"watchers did not come up: {Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.05)

    def finish(self) -> list[list[tuple[int, float]]]:
        self.stop.write_text("stop")
        self.process.wait(timeout=60)
        self.log.close()
        if not self.out.exists():
            raise Unmeasurable(f"watchers failed: {Path(self.log.name).read_text()[-2000:]}")
        return [[tuple(x) for x in w] for w in json.loads(self.out.read_text())["received"]]


def paced(rate: float, seconds: float, act) -> dict[int, float]:
    """Call ``act(n)`` ``rate`` times a second for ``seconds``; ``act`` answers the send time."""
    sent: dict[int, float] = {}
    interval = 1.0 / rate
    start = time.monotonic()
    for n in range(int(rate * seconds)):
        delay = start + n * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent[n] = act(n)
    return sent


def judge(sent: dict[int, float], received: list[list[tuple[int, float]]], expected_of) -> dict:
    latencies, delivered, expected = [], 0, 0
    for index, events in enumerate(received):
        want = expected_of(index)
        expected += len(want)
        seen = {n: at for n, at in events if n in want}
        delivered += len(seen)
        latencies += [at - sent[n] for n, at in seen.items()]
    out = stats_ms(latencies)
    out.update({"expected": expected, "delivered": delivered,
                "delivered_pct": round(100 * delivered / expected, 3) if expected else None})
    return out


def commit_change(stream: str, turn: str):
    from django.db import transaction

    from chorus_site.events import event_append

    def act(n: int) -> float:
        with transaction.atomic():
            event_append(stream=stream, kind="turn.status", data={"id": turn, "status": "running", "n": n})
            at = time.time()  # just before COMMIT; the broadcast follows it (on_commit)
        return at

    return act


def scenario(name: str, portal: Portal, tmp: Path, cookie: str, sessions: list[dict], watchers: int, rate: float,
             seconds: float) -> dict:
    streams = [f"session:{sessions[i % len(sessions)]['session']}" for i in range(watchers)]
    ws_url = portal.url.replace("http://", "ws://") + "/ws/live/"
    group = Watchers(tmp, f"{portal.server}-{name}", {"mode": "websocket", "url": ws_url, "cookie": cookie,
                                                      "origin": portal.url, "streams": streams})
    group.wait_ready()
    acts = [commit_change(f"session:{s['session']}", s["turn"]) for s in sessions]
    cpu0 = cpu_seconds(portal.pid())
    sent = paced(rate, seconds, lambda n: acts[n % len(acts)](n))
    time.sleep(2.0)  # the last deliveries
    cpu = cpu_seconds(portal.pid()) - cpu0
    received = group.finish()
    per_session = {i: {n for n in sent if n % len(sessions) == i} for i in range(len(sessions))}
    result = judge(sent, received, lambda index: per_session[index % len(sessions)])
    result.update({"scenario": name, "watchers": watchers, "sessions": len(sessions), "rate_per_s": rate,
                   "seconds": seconds, "portal_cpu_s": round(cpu, 2)})
    result["met"] = (result["p50_ms"] is not None and result["p50_ms"] <= TARGET_P50_MS
                     and result["p99_ms"] <= TARGET_P99_MS and result["delivered"] == result["expected"])
    return result


def pubsub_floor(tmp: Path, redis_url: str, subscribers: int, rate: float, seconds: float) -> dict:
    import redis

    group = Watchers(tmp, "pubsub", {"mode": "pubsub", "redis_url": redis_url, "subscribers": subscribers})
    group.wait_ready()
    client = redis.Redis.from_url(redis_url)

    def act(n: int) -> float:
        at = time.time()
        client.publish("bench-p1-floor", str(n))
        return at

    sent = paced(rate, seconds, act)
    time.sleep(1.0)
    client.close()
    received = group.finish()
    result = judge(sent, received, lambda index: set(sent))
    result.update({"subscribers": subscribers, "rate_per_s": rate, "seconds": seconds})
    return result


def make_sessions(url: str, token: str, connection, cwd: str, count: int) -> list[dict]:
    sessions = []
    for _ in range(count):
        status, body = http_json("POST", url + "/api/v1/sessions",
                                 {"connection": str(connection.pk), "cwd": cwd, "prompt": "@reply bench"}, token)
        if status != 201:
            raise Unmeasurable(f"POST /sessions answered {status}: {body}")
        sessions.append(body)
    return sessions


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--watchers", type=int, default=200)
    p.add_argument("--rate", type=float, default=20.0, help="changes per second (default 20)")
    p.add_argument("--seconds", type=float, default=10.0, help="per scenario and server (default 10)")
    p.add_argument("--sessions", type=int, default=50, help="sessions of the spread scenario (default 50)")
    p.add_argument("--servers", default="daphne,uvicorn")
    p.add_argument("--database-url", default="postgres://root@127.0.0.1:5432/chorus_bench_p1")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--watchers-child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.watchers_child:
        watchers_child(json.loads(args.watchers_child))
        return 0
    command = ".venv/bin/python bench/p1_fanout.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv) if a != "--no-docs")
    tmp = Path(tempfile.mkdtemp(prefix="chorus-bench-p1-"))
    (tmp / "work" / "app").mkdir(parents=True)
    doc = {"target": "P1", "date": dt.date.today().isoformat(), "command": command,
           "load_average_start": round(os.getloadavg()[0], 2)}
    log(f"bench database {args.database_url}; logs in {tmp}")
    prepare_database(args.database_url, args.redis_url)
    from benchdb import database_recreate

    try:
        doc["versions"] = versions()
        user, token = operator_with_token("bench-p1")
        cookie = session_cookie(user)
        env = environment(args.database_url, args.redis_url, tmp)
        cwd = str(tmp / "work")
        connection, _key = online_connection("bench-p1", cwd)
        log(f"raw floor: Redis pub/sub to {args.watchers} subscribers")
        doc["raw_floor"] = pubsub_floor(tmp, args.redis_url, args.watchers, args.rate, args.seconds)
        doc["servers"] = []
        sessions = None
        for server in [s.strip() for s in args.servers.split(",") if s.strip()]:
            if not server_available(server):
                doc["servers"].append({"server": server, "skipped": "not installed (pip install -e .[bench])"})
                continue
            portal = Portal(server, env, tmp).start()
            try:
                if sessions is None:
                    from django.utils import timezone

                    from sessions_app.models import Connection

                    # No daemon runs here: the connection is kept "online" by hand (the floor took a while).
                    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now())
                    sessions = make_sessions(portal.url, token, connection, cwd + "/app", args.sessions)
                results = []
                for name, chosen in (("one session", sessions[:1]), (f"{args.sessions} sessions", sessions)):
                    log(f"{server}: {args.watchers} watchers on {name}, {args.rate:g} changes/s for {args.seconds:g} s")
                    results.append(scenario(name, portal, tmp, cookie, chosen, args.watchers, args.rate, args.seconds))
                doc["servers"].append({"server": server, "scenarios": results})
            finally:
                portal.stop()
        floor = doc["raw_floor"]
        for entry in doc["servers"]:
            for r in entry.get("scenarios", []):
                if r["p50_ms"] and floor["p50_ms"]:
                    r["ratio_p50_to_pubsub"] = round(r["p50_ms"] / floor["p50_ms"], 1)
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
    v, floor = doc["versions"], doc["raw_floor"]
    rows = []
    for entry in doc["servers"]:
        if "skipped" in entry:
            rows.append(f"| {entry['server']} | skipped: {entry['skipped']} | | | | |")
            continue
        for r in entry["scenarios"]:
            rows.append(f"| {entry['server']} | {r['watchers']} watchers, {r['scenario']} | **{r['p50_ms']}** / "
                        f"**{r['p99_ms']}** | {r['delivered']}/{r['expected']} ({r['delivered_pct']} %) | "
                        f"×{r.get('ratio_p50_to_pubsub', '–')} | {'yes' if r['met'] else 'no'} |")
    return "\n".join([
        f"Target (SPEC §11 P1): status commit → WebSocket client with 200 watchers at 20 changes/s: p50 ≤ "
        f"{TARGET_P50_MS:g} ms, p99 ≤ {TARGET_P99_MS:g} ms, 100 % delivered; ratio to a raw Redis pub/sub round trip; "
        "daphne and uvicorn.",
        "",
        f"Measured {doc['date']} on {v['cores']} cores shared with other work (load average {doc['load_average_start']} "
        f"at the start, {doc['load_average_end']} at the end: the watchers' client process, the committing process "
        f"and the portal share those cores, so absolute figures are inflated); Python {v['python']}, channels "
        f"{v['channels']}, channels_redis {v['channels_redis']}, daphne {v['daphne']}, uvicorn {v['uvicorn']}; code "
        f"at {v['commit']}. Command:",
        "",
        "```",
        doc["command"],
        "```",
        "",
        "Latency: from just before the COMMIT of the change (a `turn.status` event appended in its own "
        "transaction; the broadcast follows the commit) to the watcher's receipt of the frame, same clock.",
        "",
        "| server | scenario | p50 / p99 (ms) | delivered | p50 vs pub/sub | met |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Raw floor, same run: Redis PUBLISH → {floor['subscribers']} subscribers at the same rate: p50 "
        f"{floor['p50_ms']} ms, p99 {floor['p99_ms']} ms, {floor['delivered_pct']} % delivered.",
    ])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Unmeasurable as exc:
        log(f"cannot measure: {exc}")
        sys.exit(2)
