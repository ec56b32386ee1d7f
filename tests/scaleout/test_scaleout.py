"""Scale-out (issue 9 item 5): two portal processes, two Celery workers, two daemons, one
PostgreSQL and one Redis (the test's own).

- An action posted on either portal process reaches a daemon connected to the other one: each
  turn is started and interrupted through the process its daemon is *not* connected to, and the
  stop is confirmed by that daemon.
- Live clients on either process (a /ws/live/ socket and SSE streams on each) see every event of
  both sessions, none twice.
- Each periodic job runs once per period although both workers run a beat (``-B``): runs of one
  job are never closer than half its period (chorus_site/periodic.py claims the period).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from chorus_site.models import Event
from chorus_site.periodic import runs_key, schedule_periods
from chorus_site.tokens import token_create
from sessions_app import services
from sessions_app.models import Turn
from tests.e2e.conftest import (
    BRIDGE_SIGINT_TIMEOUT_S,
    ROOT,
    Api,
    Daemon,
    free_port,
    kill_group,
    start_portal,
    stop_process,
    test_database_url as database_url_of_tests,
    wait_online,
    wait_until,
)
from tests.faults.clients import SseFollower, WsFollower
from tests.faults.conftest import OwnRedis
from tests.faults.test_redis_restart import session_cookie

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.postgres]

WORKERS = 2
FAST_JOBS_MIN_RUNS = 3  # runs of each 5-second job seen before judging their spacing


def start_worker_with_beat(index: int, tmp_path, env: dict) -> subprocess.Popen:
    log_path = tmp_path / f"worker-{index}.log"
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "chorus_site", "worker", "-B", "--pool=solo", "--concurrency=1",
         "-n", f"scaleout{index}@%h", "--without-gossip", "--without-mingle", "--loglevel=INFO",
         "-s", str(tmp_path / f"beat-schedule-{index}")],
        cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
    )


@pytest.fixture
def cluster(tmp_path, monkeypatch, operator):
    redis = OwnRedis(tmp_path).start()
    monkeypatch.setenv("REDIS_URL", redis.url)  # read by start_portal and the workers' environment
    monkeypatch.setenv("CHORUS_SSE_HEARTBEAT_S", "2")
    started: list[subprocess.Popen] = []
    daemons: list[Daemon] = []
    try:
        env = {**os.environ, "DATABASE_URL": database_url_of_tests(), "CHORUS_DATA_DIR": str(tmp_path)}
        workers = [start_worker_with_beat(i, tmp_path, env) for i in range(WORKERS)]
        started += workers
        ports = [free_port(), free_port()]
        with ThreadPoolExecutor(2) as pool:  # both portals start at once (each waits until it serves)
            for process in pool.map(lambda i: start_portal(ports[i], tmp_path, name=f"daphne-{i}"), range(2)):
                started.append(process)
        portals = [f"http://127.0.0.1:{port}" for port in ports]
        connections = []
        for i, portal in enumerate(portals):
            workspace = tmp_path / f"workspace-{i}"
            workspace.mkdir()
            home = tmp_path / f"daemon-{i}"
            home.mkdir()
            connection, key = services.connection_register(name=f"scaleout-{i}", backend="scripted",
                                                           cwds=[str(workspace)],
                                                           sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S)
            daemons.append(Daemon(portal, key, str(workspace), home, sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S).start())
            connections.append((connection, workspace))
        for i, worker in enumerate(workers):
            wait_until(lambda: worker.poll() is not None or "ready" in (tmp_path / f"worker-{i}.log").read_text(),
                       timeout=60, message=f"Celery worker {i} to be ready")
            assert worker.poll() is None, (tmp_path / f"worker-{i}.log").read_text()[-3000:]
        for connection, _ in connections:
            wait_online(connection)
        _token, raw = token_create(user=operator, name="scaleout")
        yield {"portals": portals, "apis": [Api(p, raw) for p in portals], "connections": connections,
               "daemons": daemons, "redis": redis, "token": raw}
    finally:
        for daemon in daemons:
            daemon.stop()
        for process in reversed(started):
            stop_process(process)
        for turn in Turn.objects.exclude(pid=None):
            kill_group(turn.pid)
        redis.stop()


def start_turn(api: Api, connection, workspace) -> Turn:
    status, body = api.call("POST", "/sessions", {"connection": str(connection.pk), "cwd": str(workspace),
                                                  "prompt": "@sleep 300\nLong work"})
    assert status == 201, body
    return Turn.objects.get(pk=body["turn"])


def test_two_portals_two_workers_two_daemons(cluster, operator):
    api = cluster["apis"]
    (connection_a, workspace_a), (connection_b, workspace_b) = cluster["connections"]
    # Daemon A is connected to portal 0, daemon B to portal 1: each turn is started and stopped
    # through the portal its daemon is not connected to.
    turn_b = start_turn(api[0], connection_b, workspace_b)
    turn_a = start_turn(api[1], connection_a, workspace_a)
    streams = [f"session:{turn_a.session_id}", f"session:{turn_b.session_id}"]

    cookie = session_cookie(operator)
    ws = [WsFollower(portal, cookie, streams) for portal in cluster["portals"]]
    sse = [SseFollower(portal, cluster["token"], f"/api/v1/sessions/{stream.split(':', 1)[1]}/events/stream", stream,
                       stall_s=8) for portal in cluster["portals"] for stream in streams]
    for follower in ws + sse:
        follower.start()
    try:
        wait_until(lambda: all(f.subscribed.is_set() for f in ws), timeout=20, message="the WebSocket followers")
        wait_until(lambda: all(f.connected.is_set() for f in sse), timeout=20, message="the SSE followers")
        wait_until(lambda: Turn.objects.filter(pk__in=[turn_a.pk, turn_b.pk], status="running").count() == 2,
                   timeout=30, message="both turns to run on their daemons")

        for turn, through in ((turn_b, api[0]), (turn_a, api[1])):
            status, body = through.call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "scale-out"})
            assert status == 200, body
        for turn in (turn_a, turn_b):
            wait_until(lambda: Turn.objects.filter(pk=turn.pk, status="interrupted", interrupted_reason="user",
                                                   stop_state="confirmed").exists(),
                       timeout=30, message=f"the stop of {turn.pk} confirmed by the daemon on the other portal")
        assert Turn.objects.get(pk=turn_b.pk).connection_id == connection_b.pk
        assert Turn.objects.get(pk=turn_a.pk).connection_id == connection_a.pk

        stored = {s: list(Event.objects.filter(stream=s).order_by("id").values_list("id", flat=True)) for s in streams}
        assert all(len(ids) >= 3 for ids in stored.values()), stored  # created, running, interrupted at least

        def everything_everywhere():
            return (all(set(f.received.ids(s)) >= set(ids) for f in ws for s, ids in stored.items())
                    and all(set(f.received.ids(f.stream)) >= set(stored[f.stream]) for f in sse))

        def missing() -> dict:
            out = {f"ws {f.url} {s}": sorted(set(ids) - set(f.received.ids(s))) for f in ws for s, ids in stored.items()}
            out.update({f"sse {f.port} {f.stream}": sorted(set(stored[f.stream]) - set(f.received.ids(f.stream)))
                        for f in sse})
            return {k: v for k, v in out.items() if v}

        try:
            wait_until(everything_everywhere, timeout=20, message="every event at every follower on both portals")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: missing {missing()}; stored {stored}") from None
    finally:
        for follower in ws + sse:
            follower.stop()
    for follower in ws:
        for stream in streams:
            got = follower.received.ids(stream)
            assert len(got) == len(set(got)), f"duplicates on {stream} at {follower.url}"
    for follower in sse:
        got = follower.received.ids(follower.stream)
        assert len(got) == len(set(got)), f"duplicates on {follower.stream} over SSE"

    # Two beats send every job twice per period; each must still run once per period.
    redis = cluster["redis"].client()
    fast_jobs = {name: period for name, period in schedule_periods().items() if period <= 10}
    assert fast_jobs, "the beat schedule has no frequent job to watch"

    def runs_of(name):
        return [float(t) for t in redis.lrange(runs_key(name), 0, -1)]

    wait_until(lambda: all(len(runs_of(name)) >= FAST_JOBS_MIN_RUNS for name in fast_jobs), timeout=30,
               message=f"{FAST_JOBS_MIN_RUNS} runs of each frequent periodic job")
    for name, period in fast_jobs.items():
        runs = sorted(runs_of(name))
        gaps = [round(b - a, 2) for a, b in zip(runs, runs[1:])]
        assert min(gaps) >= period / 2, f"{name} (every {period:g} s) ran twice in one period: gaps {gaps}"
