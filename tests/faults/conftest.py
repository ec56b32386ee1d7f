"""Fault-injection fixtures (issue 7): the project's own Redis, and the whole stack pointed at it.

``own_redis`` is a ``redis-server`` started by the test on a free port, never the machine's shared
one, so a test may kill and restart it.  ``fault_stack`` is the e2e ``bridge`` (daphne, a Celery
worker with beat, one scripted daemon) with the portal and the worker on that Redis.  The test
process itself keeps the settings it started with; what it broadcasts is a wake-up only, and the
processes under test read the log.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

# The e2e fixtures are reused, not copied: importing them here makes them available to this package.
from tests.e2e.conftest import (  # noqa: F401
    BRIDGE_SIGINT_TIMEOUT_S,
    Api,
    Daemon,
    celery_beat_worker,
    free_port,
    kill_group,
    portal_server,
    wait_online,
    wait_until,
    workspace,
)
from chorus_site.tokens import token_create
from sessions_app import services
from sessions_app.models import Turn

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class OwnRedis:
    """A throw-away ``redis-server``: no persistence, so a restart starts it empty."""

    def __init__(self, tmp_path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = tmp_path / f"redis-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> "OwnRedis":
        log = open(self.log_path, "a")
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        wait_until(self._answers, timeout=20, message=f"redis-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"redis-server exited: {self.log_path.read_text()[-2000:]}")
        try:
            return redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1).ping()
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self):
        """SIGKILL: no shutdown, no save; every client sees its connection reset."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self, down_s: float = 0.0):
        """Kill it and start it again, empty, on the same port (after ``down_s`` of outage)."""
        self.kill()
        if down_s:
            time.sleep(down_s)  # the outage itself is the fault being injected, not a wait for a condition
        self.restarts += 1
        self.start()

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of the test's own (``.url``, ``.port``, ``.restart()``, ``.kill()``, ``.stop()``)."""
    server = OwnRedis(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fault_stack(own_redis, monkeypatch, request, operator, workspace, tmp_path):
    """Like the e2e ``bridge``, with daphne and the Celery worker (+ beat) on ``own_redis``.

    Yields ``{"connection", "daemon", "api", "workspace", "key", "portal", "redis", "token"}``.
    The daemon speaks only HTTP/WebSocket to the portal, so it needs no Redis of its own.
    """
    monkeypatch.setenv("REDIS_URL", own_redis.url)  # read by start_portal and the worker fixture
    portal = request.getfixturevalue("portal_server")
    request.getfixturevalue("celery_beat_worker")
    connection, key = services.connection_register(name="fault-daemon", backend="scripted", cwds=[str(workspace)],
                                                   sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S)
    daemon = Daemon(portal, key, str(workspace), tmp_path, sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S).start()
    _token, raw = token_create(user=operator, name="faults")
    api = Api(portal, raw)
    wait_online(connection)
    try:
        yield {"connection": connection, "daemon": daemon, "api": api, "workspace": workspace, "key": key,
               "portal": portal, "redis": own_redis, "token": raw}
    finally:
        daemon.stop()
        for turn in Turn.objects.exclude(pid=None):
            kill_group(turn.pid)
