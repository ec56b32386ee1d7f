"""What the event-path benchmarks (p1_fanout.py, p3_ingest.py, l1_chatty.py) share: a bench database,
a portal process (daphne or uvicorn) on loopback, an operator with a token, a registered daemon
connection, statistics and their section of docs/benchmarks.md.

Each script stays one command and prints one JSON document; this module only keeps them short.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchdb import database_recreate  # bench/ is on sys.path: scripts run as files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
DEFAULT_REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/10")


class Unmeasurable(RuntimeError):
    """The stack did not come up or a step failed: no figure."""


def log(message: str) -> None:
    print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_until(predicate, *, timeout: float, message: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Unmeasurable(f"timed out waiting for {message}")
        time.sleep(interval)


def percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def stats_ms(samples_s: list[float]) -> dict:
    ms = [s * 1000 for s in samples_s]
    return {"n": len(ms), "p50_ms": _round(percentile(ms, 50)), "p99_ms": _round(percentile(ms, 99)),
            "max_ms": _round(max(ms) if ms else None)}


def _round(value):
    return None if value is None else round(value, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen | None) -> None:
    """SIGTERM its group (started in a session of its own), then SIGKILL."""
    if process is None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except OSError:
            process.send_signal(sig)
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass


def redis_flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def environment(database_url: str, redis_url: str, tmp: Path, **extra) -> dict:
    return {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "DJANGO_SECRET_KEY": "bench-event-path",
            "DJANGO_HTTPS": "0", "DJANGO_DEBUG": "0", "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
            "CHORUS_DATA_DIR": str(tmp / "portal-data"), "CHORUS_LOG_LEVEL": "WARNING", **extra}


def django_setup(database_url: str, redis_url: str) -> None:
    os.environ.update({"DATABASE_URL": database_url, "REDIS_URL": redis_url, "DJANGO_SECRET_KEY": "bench-event-path",
                       "DJANGO_SETTINGS_MODULE": "chorus_site.settings", "DJANGO_DEBUG": "0", "DJANGO_HTTPS": "0"})
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def prepare_database(database_url: str, redis_url: str) -> None:
    database_recreate(database_url)
    redis_flush(redis_url)
    django_setup(database_url, redis_url)
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def server_available(server: str) -> bool:
    if server == "daphne":
        return True
    try:
        __import__(server)
        return True
    except ImportError:
        return False


class Portal:
    """One portal process (``daphne`` or ``uvicorn``) serving chorus_site.asgi on loopback."""

    def __init__(self, server: str, env: dict, tmp: Path):
        self.server, self.env, self.tmp = server, env, tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log_path = tmp / f"{server}.log"

    def start(self) -> "Portal":
        argv = {"daphne": [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                           "chorus_site.asgi:application"],
                "uvicorn": [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(self.port),
                            "--log-level", "warning", "--ws", "websockets", "--no-access-log",
                            "chorus_site.asgi:application"]}[self.server]
        log_file = open(self.log_path, "a")
        self.process = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        log_file.close()

        def up():
            if self.process.poll() is not None:
                raise Unmeasurable(f"{self.server} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                return urllib.request.urlopen(self.url + "/admin/login/", timeout=1).status == 200
            except OSError:
                return False

        wait_until(up, timeout=60, message=f"{self.server} to serve", interval=0.1)
        return self

    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        stop_process(self.process)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children so far (from /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks


def operator_with_token(name: str):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from chorus_site.permissions import OPERATOR
    from chorus_site.tokens import token_create

    user = get_user_model().objects.create_user(name, f"{name}@example.invalid", None, is_staff=True)
    user.groups.add(Group.objects.get(name=OPERATOR))
    _token, raw = token_create(user=user, name=name)
    return user, raw


def session_cookie(user) -> str:
    """A signed-in browser's session cookie value for ``user`` (the /ws/live/ consumer's auth)."""
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.sessions.backends.db import SessionStore

    store = SessionStore()
    store[SESSION_KEY] = str(user.pk)
    store[BACKEND_SESSION_KEY] = settings.AUTHENTICATION_BACKENDS[-1]  # the model backend (axes only guards logins)
    store[HASH_SESSION_KEY] = user.get_session_auth_hash()
    store.save()
    return f"{settings.SESSION_COOKIE_NAME}={store.session_key}"


def online_connection(name: str, cwd: str):
    from django.utils import timezone

    from sessions_app.models import Connection
    from sessions_app.services import connection_register

    connection, key = connection_register(name=name, backend="scripted", cwds=[cwd])
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    return connection, key


def http_json(method: str, url: str, body: dict | None, bearer: str, timeout: float = 60) -> tuple[int, dict]:
    data = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {bearer}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def of(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = not os.environ.get("BENCH_COMMIT") and bool(subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {"python": platform.python_version(), "django": of("django"), "channels": of("channels"),
            "channels_redis": of("channels-redis"), "daphne": of("daphne"), "uvicorn": of("uvicorn"),
            "cores": os.cpu_count(), "commit": commit + (" + uncommitted changes" if dirty else "")}


def docs_write(title: str, body: str) -> None:
    """Replace (or add, at the end) the section ``## <title>`` of docs/benchmarks.md, nothing else."""
    heading = f"## {title}"
    text = DOCS.read_text()
    section = f"{heading}\n\n{body.strip()}\n"
    match = re.search(rf"^{re.escape(heading)}\n", text, flags=re.M)
    if match:
        following = re.search(r"^## ", text[match.end():], flags=re.M)
        end = match.end() + following.start() if following else len(text)
        text = text[:match.start()] + section + ("\n" if following else "") + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    DOCS.write_text(text.rstrip("\n") + "\n")
