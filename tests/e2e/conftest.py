"""A real portal process (daphne: HTTP + WebSocket) on the test database, and a real browser."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from django.db import connection

from chorus_site.tokens import token_create
from sessions_app import services
from chorus_site.models import Event
from sessions_app.models import Connection, Turn

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, *, timeout: float, interval: float = 0.1, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def test_database_url() -> str:
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class PortalUrl(str):
    """The portal's base URL, carrying its process for tests that stop it."""

    process: subprocess.Popen


@pytest.fixture
def portal_server(transactional_db, tmp_path):
    """daphne serving chorus_site.asgi on a free port, against this test's database."""
    if connection.vendor != "postgresql" or not os.environ.get("REDIS_URL"):
        pytest.fail("the portal process needs DATABASE_URL (PostgreSQL) and REDIS_URL to share state with the test")
    port = free_port()
    url = PortalUrl(f"http://127.0.0.1:{port}")
    url.process = start_portal(port, tmp_path)
    try:
        yield url
    finally:
        stop_process(url.process)


@pytest.fixture
def browser(monkeypatch):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the test's ORM calls are still
    # plain synchronous code, which Django's async-safety check cannot tell.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"],
        )
        try:
            yield instance
        finally:
            instance.close()


def admin_login(page, base_url: str, user, password: str = "pw-Chorus-123"):
    """Log ``user`` in through the login form of the portal process.

    The test process hashes passwords with a fast test-only hasher that the portal process does
    not accept, so the password is first stored with the production hasher.
    """
    from django.contrib.auth.hashers import make_password

    user.password = make_password(password, hasher="pbkdf2_sha256")
    user.save(update_fields=["password"])
    page.goto(base_url + "/admin/login/")
    page.fill("#id_username", user.get_username())
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_url(base_url + "/admin/")


@pytest.fixture
def celery_worker_process(transactional_db, tmp_path):
    """A real Celery worker (Redis broker) on this test's database, on a queue of its own."""
    if not os.environ.get("REDIS_URL"):
        pytest.fail("a Celery worker needs REDIS_URL as its broker")
    queue = f"test-{os.getpid()}-{free_port()}"
    env = {**os.environ, "DATABASE_URL": test_database_url(), "CHORUS_DATA_DIR": str(tmp_path)}
    log = open(tmp_path / "celery.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "chorus_site", "worker", "--pool=solo", "--concurrency=1",
         "-Q", queue, "--without-gossip", "--without-mingle", "--loglevel=INFO"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: "ready" in (tmp_path / "celery.log").read_text() or process.poll() is not None,
                   timeout=60, message="the Celery worker to be ready")
        if process.poll() is not None:
            raise AssertionError((tmp_path / "celery.log").read_text()[-3000:])
        yield queue
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def start_portal(port: int, tmp_path, name: str = "daphne") -> subprocess.Popen:
    env = {**os.environ, "DATABASE_URL": test_database_url(), "DJANGO_HTTPS": "0", "CHORUS_SERVE_STATIC": "1",
           "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost", "CHORUS_DATA_DIR": str(tmp_path)}
    log = open(tmp_path / f"{name}.log", "a")
    process = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "chorus_site.asgi:application"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        if process.poll() is not None:
            raise AssertionError(f"daphne exited: {(tmp_path / f'{name}.log').read_text()[-2000:]}")
        try:
            return urllib.request.urlopen(url + "/admin/login/", timeout=1).status == 200
        except OSError:
            return False

    wait_until(up, timeout=30, message="daphne to serve")
    return process


def stop_process(process: subprocess.Popen, sig=None):
    if process.poll() is None:
        process.send_signal(sig or 15)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture
def celery_beat_worker(transactional_db, tmp_path):
    """A worker with an embedded beat on the default queue: stop deadlines and the stale sweep."""
    env = {**os.environ, "DATABASE_URL": test_database_url(), "CHORUS_DATA_DIR": str(tmp_path)}
    log_path = tmp_path / "celery-beat.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "chorus_site", "worker", "-B", "--pool=solo", "--concurrency=1",
         "--without-gossip", "--without-mingle", "--loglevel=INFO", "-s", str(tmp_path / "beat-schedule")],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: "ready" in log_path.read_text() or process.poll() is not None, timeout=60,
                   message="the Celery worker to be ready")
        if process.poll() is not None:
            raise AssertionError(log_path.read_text()[-3000:])
        yield process
    finally:
        stop_process(process)
        log.close()


class Daemon:
    """A real ``chorus_daemon`` process for one connection."""

    def __init__(self, portal_url: str, key: str, cwd: str, tmp_path, sigint_timeout_s: int = 2):
        self.args = [sys.executable, "manage.py", "chorus_daemon", "--portal", portal_url, "--key", key, "--cwd", cwd,
                     "--backend", "scripted", "--sigint-timeout", str(sigint_timeout_s),
                     "--spool-dir", str(tmp_path / "spool")]
        self.env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
        self.env["CHORUS_SCRIPTED_HOME"] = str(tmp_path / "scripted-home")
        self.env["CHORUS_DATA_DIR"] = str(tmp_path / "daemon-data")
        self.log_path = tmp_path / "daemon.log"
        self.process = None

    def start(self):
        log = open(self.log_path, "a")
        self.process = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def kill(self):
        stop_process(self.process, 9)

    def stop(self):
        if self.process is not None:
            stop_process(self.process)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


# ---------------------------------------------------------------- the whole bridge, for e2e tests
BRIDGE_SIGINT_TIMEOUT_S = 2


class Api:
    def __init__(self, base: str, token: str):
        self.base, self.token = base, token

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body or {}).encode() if method == "POST" else None
        request = urllib.request.Request(self.base + "/api/v1" + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")


@pytest.fixture
def workspace(tmp_path):
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
def bridge(portal_server, celery_beat_worker, operator, workspace, tmp_path):
    connection, key = services.connection_register(name="e2e-daemon", backend="scripted", cwds=[str(workspace)],
                                                   sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S)
    daemon = Daemon(portal_server, key, str(workspace), tmp_path, sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S).start()
    _token, raw = token_create(user=operator, name="e2e")
    api = Api(portal_server, raw)
    wait_online(connection)
    yield {"connection": connection, "daemon": daemon, "api": api, "workspace": workspace, "key": key,
           "portal": portal_server}
    daemon.stop()
    for turn in Turn.objects.exclude(pid=None):
        kill_group(turn.pid)


def wait_online(connection, timeout=30):
    wait_until(lambda: Connection.objects.filter(pk=connection.pk, status="online",
                                                 last_heartbeat_at__isnull=False).exists(),
               timeout=timeout, message="the daemon to come online")


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
    return True


def output_value(turn, key, timeout=20):
    def find():
        for event in Event.objects.filter(stream=turn.stream, kind="turn.output").order_by("id"):
            agent = event.data.get("data") or {}  # the agent's own data (nested by the bridge)
            if key in agent:
                return agent[key]
        return None

    return wait_until(find, timeout=timeout, message=f"agent output with {key}")
