"""Embedded mode in one process tree: the portal (daphne), a local daemon with the scripted agent,
and the periodic sweeps that Celery beat runs in production.  Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

LOCAL_CONNECTION = "local-scripted"
SWEEP_EVERY_S = 5
PURGE_EVERY_S = 3600


class Command(BaseCommand):
    help = "Serve the portal with a local daemon (scripted agent) and in-process sweeps (embedded mode)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-daemon", action="store_true", help="serve the portal only")
        parser.add_argument("--demo-logins", action="store_true",
                            help="give the demo users new passwords and print them, with the URL, once serving")

    def handle(self, *args, host, port, no_daemon, demo_logins=False, **options):
        from .chorus_demo import demo_workspace

        workspace = demo_workspace()
        base = f"http://{host}:{port}"
        children: list[subprocess.Popen] = []
        stop = threading.Event()

        def shutdown(*_):
            stop.set()

        signal.signal(signal.SIGINT, shutdown)
        signal.signal(signal.SIGTERM, shutdown)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        children.append(subprocess.Popen([sys.executable, "-m", "daphne", "-b", host, "-p", str(port),
                                          "chorus_site.asgi:application"], env=env))
        if not self._wait_for(base + "/admin/login/", stop, children[0]):
            self._stop(children)
            raise CommandError(f"the portal did not start on {base}")
        if not no_daemon:
            key = self._local_connection_key(str(workspace))
            children.append(subprocess.Popen(
                [sys.executable, "manage.py", "chorus_daemon", "--portal", base, "--key", key, "--cwd", str(workspace),
                 "--backend", "scripted", "--sigint-timeout", "5", "--spool-dir", str(Path(settings.DATA_DIR) / "daemon-spool")],
                cwd=settings.BASE_DIR, env=env))
            self.stdout.write(f"Local daemon: connection {LOCAL_CONNECTION}, scripted agent, directory {workspace}")
        threading.Thread(target=self._sweeps, args=(stop,), daemon=True).start()
        # Last of the start-up output, so the logins do not scroll away among daphne's lines: after
        # the local daemon said hello (its own log lines come first), or 15 s at most.
        if not no_daemon:
            self._wait_local_online(stop, timeout=15)
        self._banner(base, self._demo_logins() if demo_logins else [])
        try:
            while not stop.is_set():
                for child in children:
                    if child.poll() is not None:
                        self.stderr.write(f"{child.args[2:4]} exited with {child.returncode}; stopping")
                        stop.set()
                stop.wait(0.5)
        finally:
            self._stop(children)

    @staticmethod
    def _wait_local_online(stop: threading.Event, timeout: float):
        from django.db import close_old_connections

        from sessions_app.models import Connection

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop.is_set():
            close_old_connections()
            if Connection.objects.filter(name=LOCAL_CONNECTION, status="online").exists():
                stop.wait(0.5)  # its hello's log lines
                return
            stop.wait(0.3)

    @staticmethod
    def _demo_logins():
        from .chorus_demo import Command as Demo

        return Demo()._users()

    def _banner(self, base: str, logins):
        lines = ["", "=" * 72, f"Chorus Ops is running: open {base}/admin/", f"API docs: {base}/api/v1/docs"]
        if logins:
            lines.append("Demo logins (new passwords on every start):")
            lines += [f"  {username:<12} {password:<26} {role}" for username, role, password in logins]
        lines += ["Stop: press Ctrl-C here (stops the portal, the local daemon and the sweeps).", "=" * 72]
        self.stdout.write("\n".join(lines))
        self.stdout.flush()

    def _local_connection_key(self, workspace: str) -> str:
        from sessions_app.models import Connection
        from sessions_app.services import connection_register, connection_rotate_key

        existing = Connection.objects.filter(name=LOCAL_CONNECTION).first()
        if existing is None:
            _connection, key = connection_register(name=LOCAL_CONNECTION, host="localhost", backend="scripted",
                                                   cwds=[workspace], sigint_timeout_s=5)
            return key
        # The key is stored hashed only: a restart issues a fresh one to its own local daemon.
        return connection_rotate_key(connection_id=existing.pk, cwds=[workspace])

    def _sweeps(self, stop: threading.Event):
        from django.db import close_old_connections

        from chorus_site.tasks import events_purge_expired
        from executions.tasks import runs_tick_waiting
        from sessions_app.tasks import connections_sweep

        last_purge = 0.0
        while not stop.wait(SWEEP_EVERY_S):
            close_old_connections()
            try:
                connections_sweep.apply()
                runs_tick_waiting.apply()
                if time.monotonic() - last_purge > PURGE_EVERY_S:
                    events_purge_expired.apply()
                    last_purge = time.monotonic()
            except Exception as exc:  # keep sweeping; the next round retries
                self.stderr.write(f"sweep failed: {exc}")

    @staticmethod
    def _wait_for(url, stop, process, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop.is_set() and process.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=1):
                    return True
            except OSError:
                time.sleep(0.2)
        return False

    @staticmethod
    def _stop(children):
        # The daemon first, and wait for it: its last reports (turns it stops) still reach the portal.
        for child in reversed(children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
