"""P2 (SPEC §11): interrupt latency and the verified stop of SPEC §4.1, end to end.

Target: API call → the agent sees the stop signal, p50 ≤ 300 ms; a stop-ignoring agent and all its
descendants (also those that left its process group) gone ≤ sigint timeout + 1 s; 0 orphans in 50
trials.

The script brings up the real stack on loopback, in a PostgreSQL database of its own (created,
migrated, dropped again) and Redis database 9: daphne serving the portal, a Celery worker with
embedded beat (the stop deadline job), and ``manage.py chorus_daemon --backend scripted`` for one
registered connection. It then runs, interleaved, per trial:

* *cooperative*: a turn whose prompt is ``@sleep 300``. The scripted agent's default SIGINT handler
  prints a "stopping" line and exits 130, so "API call → agent process gone" is an upper bound of
  "API call → agent sees the stop signal" (it adds the handler, a session file write and the
  interpreter's exit). The portal's stored ``signalled`` and ``confirmed`` times are reported too.
* *stop-ignoring*: ``@ignore-stop``, ``@grandchild 300``, ``@escape 300``, ``@sleep 300``: the
  agent ignores SIGINT/SIGTERM, one child stays in its group, one calls ``setsid()``. Measured:
  API call → each of the three pids gone (checked by pid *and* start time, zombies count as
  gone), and orphans: any of them still alive 1 s after the portal shows the stop confirmed.
* *raw floors*, same machine and run: the scripted agent spawned directly in its own session;
  ``killpg(SIGINT)`` → the cooperative agent gone, and ``killpg(SIGKILL)`` → the stop-ignoring
  agent and its grandchild gone. The escaped child is not in the group, so a bare killpg leaves
  it running: counted as the raw floor's orphans (the reason the daemon samples the tree).

The API calls go through ``urllib`` with an operator's bearer token; pids are polled every
millisecond in ``/proc`` while the interrupt request runs in a thread. Portal-side times are the
``at`` of the stored events (same machine clock). Prints one JSON document and refreshes the "P2
interrupt latency" section of docs/benchmarks.md (unless ``--no-docs``).

    .venv/bin/python bench/interrupt_latency.py                  # 50 trials, about 5 minutes
    .venv/bin/python bench/interrupt_latency.py --trials 3 --no-docs
    .venv/bin/python bench/interrupt_latency.py --backend claude_code --trials 10   # real Claude Code
"""

# Over STYLE's ~600 lines on purpose: bench/ keeps one self-contained script per SPEC §11 target
# (stack, trials, raw floors and the docs section together), and it may not import tests/.

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg

from benchdb import admin_url, database_recreate  # bench/ is on sys.path: scripts run as files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## P2 interrupt latency"
TARGET_P50_MS = 300.0
GONE_MARGIN_S = 1.0        # target: everything gone within sigint_timeout_s + this
ORPHAN_CHECK_S = 1.0       # an orphan: still alive this long after the stop is confirmed
POLL_S = 0.001             # pid polling while a stop runs
STOP_CONFIRM_MARGIN_S = 5  # the portal's deadline margin (sessions_app.actions.STOP_CONFIRM_MARGIN_S)
REDIS_URL = "redis://127.0.0.1:6379/9"
# The interrupt's ControlCommand row: stored by the API, handed to the daemon's socket, acked back.
COMMAND_STAGES = ("command_created", "command_delivered", "command_acked")

PROMPT_COOPERATIVE = "@sleep 300"
PROMPT_DEAF = "@ignore-stop\n@grandchild 300\n@escape 300\n@sleep 300"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Unmeasurable(Exception):
    """The stack or a trial's set-up failed: nothing to report."""


def wait_until(predicate, *, timeout: float, message: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise Unmeasurable(f"timed out after {timeout:g} s waiting for {message}")
        time.sleep(interval)


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def stats(samples: list[float | None]) -> dict:
    values = [s for s in samples if s is not None]
    if not values:
        return {"n": 0, "missing": len(samples)}
    return {"n": len(values), "missing": len(samples) - len(values), "p50": round(percentile(values, 50), 1),
            "p95": round(percentile(values, 95), 1), "max": round(max(values), 1), "min": round(min(values), 1)}


# ------------------------------------------------------------------------------ processes
def proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of a pid, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def identify(pid: int) -> tuple[int, str]:
    stat = proc_stat(pid)
    if stat is None or stat[0] in "ZX":
        raise Unmeasurable(f"pid {pid} is already gone before the stop")
    return pid, stat[1]


def alive(ident: tuple[int, str]) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    stat = proc_stat(ident[0])
    return stat is not None and stat[1] == ident[1] and stat[0] not in "ZX"


def kill_verified(ident: tuple[int, str]) -> None:
    if alive(ident):
        try:
            os.kill(ident[0], signal.SIGKILL)
        except OSError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen | None, name: str) -> None:
    """SIGTERM the process (its own session: the whole group), then SIGKILL after 15 s."""
    if process is None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)  # started with start_new_session: pgid == pid, ours
        except OSError:
            process.send_signal(sig)
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            log(f"{name} did not stop after {sig.name}")
    try:  # whatever of its group outlived it (Celery's embedded beat)
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass


# ------------------------------------------------------------------------------ database
def redis_flush() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.flushdb()
    finally:
        client.close()


# ------------------------------------------------------------------------------ the stack
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


class Stack:
    """daphne, a Celery worker with beat, and the daemon; each in a session of its own, so a Ctrl-C
    reaches only this script, which then stops them in order."""

    def __init__(self, tmp: Path, database_url: str, sigint_timeout_s: int):
        self.tmp, self.database_url, self.sigint_timeout_s = tmp, database_url, sigint_timeout_s
        self.workspace = tmp / "workspace"
        self.workspace.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.portal = self.celery = self.daemon = None
        self.logs: list = []

    def env(self, **extra) -> dict:
        return {**os.environ, "DATABASE_URL": self.database_url, "REDIS_URL": REDIS_URL,
                "DJANGO_SECRET_KEY": "bench-p2", "DJANGO_HTTPS": "0", "DJANGO_DEBUG": "0",
                "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost", "CHORUS_DATA_DIR": str(self.tmp / "portal-data"),
                "CHORUS_LOG_LEVEL": "WARNING", **extra}

    def spawn(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        log_file = open(self.tmp / f"{name}.log", "a")
        self.logs.append(log_file)
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, name: str, size: int = 3000) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-size:] if path.exists() else ""

    def start_portal(self) -> None:
        self.portal = self.spawn("daphne", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                                            "chorus_site.asgi:application"], self.env())

        def up():
            if self.portal.poll() is not None:
                raise Unmeasurable(f"daphne exited:\n{self.log_tail('daphne')}")
            try:
                return urllib.request.urlopen(self.url + "/admin/login/", timeout=1).status == 200
            except OSError:
                return False

        wait_until(up, timeout=60, message="daphne to serve", interval=0.1)

    def start_celery(self) -> None:
        self.celery = self.spawn("celery", [
            sys.executable, "-m", "celery", "-A", "chorus_site", "worker", "-B", "--pool=solo", "--concurrency=1",
            "--without-gossip", "--without-mingle", "--loglevel=INFO", "-s", str(self.tmp / "beat-schedule")],
            self.env(CHORUS_LOG_LEVEL="INFO"))

        def ready():
            if self.celery.poll() is not None:
                raise Unmeasurable(f"the Celery worker exited:\n{self.log_tail('celery')}")
            return "ready" in self.log_tail("celery", 100_000)

        wait_until(ready, timeout=90, message="the Celery worker to be ready", interval=0.1)

    def start_daemon(self, key: str, connection_id) -> None:
        from sessions_app.models import Connection

        env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
        env.update(CHORUS_SCRIPTED_HOME=str(self.tmp / "scripted-home"), CHORUS_DATA_DIR=str(self.tmp / "daemon-data"))
        self.daemon = self.spawn("daemon", [
            sys.executable, "manage.py", "chorus_daemon", "--portal", self.url, "--key", key,
            "--cwd", str(self.workspace), "--backend", "scripted", "--sigint-timeout", str(self.sigint_timeout_s),
            "--spool-dir", str(self.tmp / "spool")], env)

        def online():
            if self.daemon.poll() is not None:
                raise Unmeasurable(f"the daemon exited:\n{self.log_tail('daemon')}")
            return Connection.objects.filter(pk=connection_id, status="online",
                                             last_heartbeat_at__isnull=False).exists()

        wait_until(online, timeout=60, message="the daemon to come online", interval=0.1)

    def stop(self) -> None:
        for process, name in ((self.daemon, "daemon"), (self.celery, "celery"), (self.portal, "daphne")):
            try:
                stop_process(process, name)
            except Exception as exc:  # noqa: BLE001 — go on stopping the others
                log(f"stopping {name} failed: {exc}")
        for log_file in self.logs:
            log_file.close()


def django_setup(database_url: str) -> None:
    os.environ.update({
        "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "DJANGO_SECRET_KEY": "bench-p2",
        "DJANGO_SETTINGS_MODULE": "chorus_site.settings", "DJANGO_DEBUG": "0", "DJANGO_HTTPS": "0",
    })
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


# ------------------------------------------------------------------------------ portal trials
class Bench:
    def __init__(self, stack: Stack, api: Api, connection_id, sigint_timeout_s: int):
        self.stack, self.api, self.connection_id, self.timeout_s = stack, api, connection_id, sigint_timeout_s
        self.leftovers: list[tuple[int, str]] = []  # every pid a trial learned: killed (verified) at the end

    def start_turn(self, prompt: str) -> tuple[str, str]:
        status, body = self.api.call("POST", "/sessions", {
            "connection": str(self.connection_id), "cwd": str(self.stack.workspace), "prompt": prompt,
            "idea_key": f"bench-p2:{uuid.uuid4()}", "acknowledge_changes": True})
        if status != 201:
            raise Unmeasurable(f"POST /sessions answered {status}: {body}")
        return body["turn"], body["session"]

    def wait_ready(self, turn_id: str, session_id: str, keys: tuple[str, ...]) -> dict:
        """The turn runs, its agent sleeps, and the output named ``keys`` (pids) is stored."""
        from chorus_site.models import Event
        from sessions_app.models import Turn

        running = Turn.objects.filter(pk=turn_id, status="running", pid__isnull=False)
        pid = wait_until(lambda: running.values_list("pid", flat=True).first(), timeout=30,
                         message=f"turn {turn_id} to run")
        found: dict = {"agent": pid}

        def ready():
            output = Event.objects.filter(stream=f"session:{session_id}", kind="turn.output")
            for data in output.values_list("data", flat=True):
                data = data.get("data") or {}  # the agent's own data, nested by the bridge
                for key in keys:
                    if key in data:
                        found[key] = int(data[key])
                if str(data.get("message", "")).startswith("working for"):
                    found["working"] = True
            return found.get("working") and all(k in found for k in keys)

        wait_until(ready, timeout=30, message=f"the agent of turn {turn_id} to report {keys} and start sleeping")
        return found

    def interrupt(self, turn_id: str, pids: dict[str, tuple[int, str]]) -> dict:
        """POST the interrupt in a thread; meanwhile poll the pids. Times in ms from the call."""
        answer: dict = {}

        def call():
            answer["result"] = self.api.call("POST", f"/turns/{turn_id}/interrupt", {"reason": "bench P2"})
            answer["ms"] = (time.perf_counter() - t0) * 1000

        thread = threading.Thread(target=call, name="interrupt", daemon=True)
        t0_wall = time.time()
        t0 = time.perf_counter()
        thread.start()
        pending, gone = dict(pids), {}
        deadline = t0 + self.timeout_s + 10
        while pending and time.perf_counter() < deadline:
            for name, ident in list(pending.items()):
                if not alive(ident):
                    gone[name] = (time.perf_counter() - t0) * 1000
                    del pending[name]
            time.sleep(POLL_S)
        thread.join(30)
        status, body = answer.get("result", (None, {}))
        if status != 200 or not body.get("dispatched"):
            raise Unmeasurable(f"interrupt of {turn_id} answered {status}: {body}")
        return {"t0_wall": t0_wall, "response_ms": answer["ms"], "gone_ms": gone}

    def settle(self, turn_id: str, session_id: str, t0_wall: float) -> dict:
        """Wait for the portal to settle the stop; the stored stages in ms from the API call."""
        from chorus_site.models import Event
        from sessions_app.models import ControlCommand, Turn

        limit = self.timeout_s + STOP_CONFIRM_MARGIN_S + 15
        turn = wait_until(lambda: Turn.objects.filter(pk=turn_id, status="interrupted").first()
                          or Turn.objects.filter(pk=turn_id, stop_state="unconfirmed").first(),
                          timeout=limit, message=f"turn {turn_id} to be settled")
        stages: dict[str, float] = {}
        changes = Event.objects.filter(stream=f"session:{session_id}", kind__in=["turn.stop_state", "turn.status"])
        for data, at in changes.order_by("id").values_list("data", "at"):
            if data.get("id") != turn_id:
                continue
            state = data.get("stop_state")
            if state and state not in stages:
                stages[state] = (at.timestamp() - t0_wall) * 1000
        command = ControlCommand.objects.filter(turn_id=turn_id, action="interrupt").order_by("id").first()
        for name in ("created_at", "delivered_at", "acked_at"):
            at = getattr(command, name, None)
            stages[f"command_{name[:-3]}"] = None if at is None else (at.timestamp() - t0_wall) * 1000
        stopping = Event.objects.filter(stream=f"session:{session_id}", kind="turn.output",
                                        data__data__message="stopping").exists()
        return {"status": turn.status, "reason": turn.interrupted_reason, "stop_state": turn.stop_state,
                "stages": stages, "stopping_line": stopping, "background_processes": turn.background_processes}

    def cooperative(self) -> dict:
        turn_id, session_id = self.start_turn(PROMPT_COOPERATIVE)
        ready = self.wait_ready(turn_id, session_id, ())
        agent = identify(ready["agent"])
        self.leftovers.append(agent)
        run = self.interrupt(turn_id, {"agent": agent})
        settled = self.settle(turn_id, session_id, run["t0_wall"])
        return {"response_ms": run["response_ms"], "agent_gone_ms": run["gone_ms"].get("agent"),
                **{f"{k}_ms": settled["stages"].get(k) for k in COMMAND_STAGES},
                "signalled_ms": settled["stages"].get("signalled"), "confirmed_ms": settled["stages"].get("confirmed"),
                "escalated": "escalated" in settled["stages"], "stopping_line": settled["stopping_line"],
                "outcome": f"{settled['status']}({settled['reason']}) stop {settled['stop_state']}",
                "orphans": int(alive(agent))}

    def stop_ignoring(self) -> dict:
        turn_id, session_id = self.start_turn(PROMPT_DEAF)
        ready = self.wait_ready(turn_id, session_id, ("grandchild_pid", "escape_pid"))
        pids = {"agent": identify(ready["agent"]), "grandchild": identify(ready["grandchild_pid"]),
                "escaped": identify(ready["escape_pid"])}
        self.leftovers.extend(pids.values())
        # The escaped child must really have left the group before the stop, or it proves nothing.
        wait_until(lambda: os.getpgid(pids["escaped"][0]) != pids["agent"][0], timeout=10,
                   message="the escaped child to call setsid()", interval=0.005)
        run = self.interrupt(turn_id, pids)
        settled = self.settle(turn_id, session_id, run["t0_wall"])
        time.sleep(ORPHAN_CHECK_S)  # the measurement's own wait: what still lives 1 s after settling
        orphans = [name for name, ident in pids.items() if alive(ident)]
        for name in orphans:
            kill_verified(pids[name])
        gone = run["gone_ms"]
        return {"response_ms": run["response_ms"], "agent_gone_ms": gone.get("agent"),
                "grandchild_gone_ms": gone.get("grandchild"), "escaped_gone_ms": gone.get("escaped"),
                "all_gone_ms": max(gone.values()) if len(gone) == len(pids) else None,
                **{f"{k}_ms": settled["stages"].get(k) for k in COMMAND_STAGES},
                "signalled_ms": settled["stages"].get("signalled"), "escalated_ms": settled["stages"].get("escalated"),
                "confirmed_ms": settled["stages"].get("confirmed"),
                "outcome": f"{settled['status']}({settled['reason']}) stop {settled['stop_state']}",
                "orphans": len(orphans), "orphan_names": orphans}


# ------------------------------------------------------------------------------ raw floors
def raw_spawn(prompt: str, cwd: Path, home: Path) -> subprocess.Popen:
    env = {**os.environ, "CHORUS_SCRIPTED_HOME": str(home), "PYTHONPATH": str(ROOT)}
    for name in ("DATABASE_URL", "REDIS_URL"):
        env.pop(name, None)
    process = subprocess.Popen([sys.executable, "-m", "agents.scripted_agent"], cwd=cwd, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    process.stdin.write(prompt.encode())
    process.stdin.close()
    return process


def raw_wait(process: subprocess.Popen, keys: tuple[str, ...], timeout: float = 30) -> dict:
    """Read the agent's JSON lines until it sleeps and has printed ``keys``."""
    found: dict = {}
    buffer = b""
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    while not (found.get("working") and all(k in found for k in keys)):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Unmeasurable(f"the raw agent did not report {keys} in {timeout:g} s")
        if not select.select([fd], [], [], remaining)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise Unmeasurable(f"the raw agent exited early ({process.wait()})")
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            data = json.loads(line)
            for key in keys:
                if key in data:
                    found[key] = int(data[key])
            if str(data.get("message", "")).startswith("working for"):
                found["working"] = True
    return found


def raw_until_gone(process: subprocess.Popen, others: list[tuple[int, str]], t0: float,
                   limit_s: float = 10) -> float | None:
    while time.perf_counter() - t0 < limit_s:
        if process.poll() is not None and not any(alive(ident) for ident in others):
            return (time.perf_counter() - t0) * 1000
        time.sleep(POLL_S)
    return None


def raw_sigint(tmp: Path) -> dict:
    process = raw_spawn(PROMPT_COOPERATIVE, tmp / "raw", tmp / "raw-home")
    try:
        raw_wait(process, ())
        t0 = time.perf_counter()
        os.killpg(process.pid, signal.SIGINT)
        ms = raw_until_gone(process, [], t0)
        return {"exit_ms": ms, "returncode": process.returncode}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
        process.stdout.close()


def raw_sigkill(tmp: Path, leftovers: list) -> dict:
    process = raw_spawn(PROMPT_DEAF, tmp / "raw", tmp / "raw-home")
    try:
        found = raw_wait(process, ("grandchild_pid", "escape_pid"))
        grandchild, escaped = identify(found["grandchild_pid"]), identify(found["escape_pid"])
        leftovers.extend([grandchild, escaped])
        wait_until(lambda: os.getpgid(escaped[0]) != process.pid, timeout=10,
                   message="the raw escaped child to call setsid()", interval=0.005)
        t0 = time.perf_counter()
        os.killpg(process.pid, signal.SIGKILL)
        ms = raw_until_gone(process, [grandchild], t0)
        orphan = alive(escaped)
        kill_verified(escaped)
        return {"group_gone_ms": ms, "escaped_orphan": orphan}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
        process.stdout.close()


# ------------------------------------------------------------------------------ report
def versions(database_url: str) -> dict:
    from importlib.metadata import version

    import redis

    with psycopg.connect(database_url, autocommit=True) as conn:
        postgres = conn.execute("SHOW server_version").fetchone()[0].split()[0]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        redis_server = client.info("server")["redis_version"]
    finally:
        client.close()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "agents", "sessions_app", "chorus_site"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split("\n")
    return {"python": platform.python_version(), "django": version("django"), "daphne": version("daphne"),
            "celery": version("celery"), "channels_redis": version("channels_redis"), "psutil": version("psutil"),
            "postgresql": postgres, "redis": redis_server, "kernel": platform.release(), "cpus": os.cpu_count(),
            "commit": head, "uncommitted": sorted(line[3:] for line in dirty if line.strip())}


def summarise(doc: dict, coop: list[dict], deaf: list[dict], raw_int: list[dict], raw_kill: list[dict]) -> None:
    timeout_ms = doc["sigint_timeout_s"] * 1000
    doc["cooperative"] = {
        "prompt": PROMPT_COOPERATIVE,
        "api_response_ms": stats([t["response_ms"] for t in coop]),
        **{f"api_to_{k}_stored_ms": stats([t[f"{k}_ms"] for t in coop]) for k in COMMAND_STAGES},
        "api_to_agent_gone_ms": stats([t["agent_gone_ms"] for t in coop]),
        "api_to_signalled_stored_ms": stats([t["signalled_ms"] for t in coop]),
        "api_to_confirmed_stored_ms": stats([t["confirmed_ms"] for t in coop]),
        "stopping_line_seen": sum(t["stopping_line"] for t in coop),
        "escalated": sum(t["escalated"] for t in coop),
        "outcomes": sorted({t["outcome"] for t in coop}),
    }
    doc["stop_ignoring"] = {
        "prompt": PROMPT_DEAF,
        "api_response_ms": stats([t["response_ms"] for t in deaf]),
        **{f"api_to_{k}_stored_ms": stats([t[f"{k}_ms"] for t in deaf]) for k in COMMAND_STAGES},
        "api_to_agent_gone_ms": stats([t["agent_gone_ms"] for t in deaf]),
        "api_to_grandchild_gone_ms": stats([t["grandchild_gone_ms"] for t in deaf]),
        "api_to_escaped_gone_ms": stats([t["escaped_gone_ms"] for t in deaf]),
        "api_to_all_gone_ms": stats([t["all_gone_ms"] for t in deaf]),
        "api_to_signalled_stored_ms": stats([t["signalled_ms"] for t in deaf]),
        "api_to_escalated_stored_ms": stats([t["escalated_ms"] for t in deaf]),
        "api_to_confirmed_stored_ms": stats([t["confirmed_ms"] for t in deaf]),
        "limit_ms": timeout_ms + GONE_MARGIN_S * 1000,
        "over_limit": sum(1 for t in deaf if t["all_gone_ms"] is None
                          or t["all_gone_ms"] > timeout_ms + GONE_MARGIN_S * 1000),
        "orphans": sum(t["orphans"] for t in deaf),
        "orphan_trials": [{"trial": i, "left": t["orphan_names"]} for i, t in enumerate(deaf) if t["orphans"]],
        "outcomes": sorted({t["outcome"] for t in deaf}),
    }
    doc["raw"] = {
        "sigint_to_exit_ms": stats([t["exit_ms"] for t in raw_int]),
        "sigint_exit_codes": sorted({t["returncode"] for t in raw_int}),
        "sigkill_to_group_gone_ms": stats([t["group_gone_ms"] for t in raw_kill]),
        "escaped_orphans": sum(t["escaped_orphan"] for t in raw_kill),
    }
    coop_p50 = doc["cooperative"]["api_to_agent_gone_ms"].get("p50")
    raw_p50 = doc["raw"]["sigint_to_exit_ms"].get("p50")
    doc["ratio_cooperative_to_raw_sigint_p50"] = round(coop_p50 / raw_p50, 2) if coop_p50 and raw_p50 else None
    deaf_all = doc["stop_ignoring"]["api_to_all_gone_ms"]
    doc["prefect_process_worker"] = ("not measured: installing Prefect would add a heavy dependency for one "
                                     "benchmark; left for later")
    doc["verdict"] = {
        "p50_to_stop_signal_le_300ms": coop_p50 is not None and coop_p50 <= TARGET_P50_MS,
        "all_gone_le_timeout_plus_1s": deaf_all.get("missing") == 0 and doc["stop_ignoring"]["over_limit"] == 0,
        "zero_orphans": doc["stop_ignoring"]["orphans"] == 0,
        "fifty_trials": doc["trials"] >= 50,
        "prefect_comparison": False,
    }
    verdict = doc["verdict"]
    doc["verdict"]["met"] = all(verdict[k] for k in ("p50_to_stop_signal_le_300ms", "all_gone_le_timeout_plus_1s",
                                                     "zero_orphans", "fifty_trials"))


def docs_section(doc: dict) -> str:
    def row(label: str, s: dict) -> str:
        if not s.get("n"):
            return f"| {label} | – | – | – | 0 |"
        missing = f" ({s['missing']} missing)" if s.get("missing") else ""
        return f"| {label} | {s['p50']:.1f} | {s['p95']:.1f} | {s['max']:.1f} | {s['n']}{missing} |"

    def over(value: float | None) -> str:
        return "–" if value is None else f"{value - timeout * 1000:.0f} ms"

    def yes(flag: bool) -> str:
        return "yes" if flag else "**no**"

    c, d, r, v = doc["cooperative"], doc["stop_ignoring"], doc["raw"], doc["verdict"]
    timeout = doc["sigint_timeout_s"]
    m = doc["versions"]
    lines = [
        SECTION, "",
        "Target (SPEC §11 P2): API call → the agent sees the stop signal, p50 ≤ 300 ms; a stop-ignoring agent "
        "and all its descendants (also those that left its group) gone ≤ timeout + 1 s; 0 orphans in 50 "
        "trials; the same scenario against Prefect's process worker, for comparison.", "",
        f"Measured {doc['date']} on {m['cpus']} cores, Linux {m['kernel']}, Python {m['python']}, Django "
        f"{m['django']}, daphne {m['daphne']}, Celery {m['celery']}, PostgreSQL {m['postgresql']}, Redis "
        f"{m['redis']}; code at {m['commit']}" + (" plus uncommitted changes to " + ", ".join(
            f"`{p}`" for p in m["uncommitted"]) if m["uncommitted"] else "") +
        f". Load average {doc['load_average']['start']} at the start, {doc['load_average']['end']} at the end "
        "(other test suites shared the machine). Command:", "",
        "```", doc["command"], "```", "",
        f"Stack on loopback: daphne (portal), a Celery worker with embedded beat, `chorus_daemon --backend "
        f"scripted --sigint-timeout {timeout}`, PostgreSQL and Redis. {doc['trials']} trials after "
        f"{doc['warmups']} warm-up, each a new session started with `POST /api/v1/sessions` and stopped with "
        "`POST /api/v1/turns/{id}/interrupt` (operator token). Times in ms from the moment the interrupt request "
        "is sent (nearest-rank percentiles). Pids are polled every millisecond in `/proc` (pid *and* start "
        "time; a zombie counts as gone); \"stored\" times are the `at` of the portal's events and the interrupt "
        "command's `created_at` / `delivered_at` / `acked_at` (same machine clock).", "",
        "What is measured, exactly:", "",
        "- **Cooperative agent** (`@sleep 300`): the scripted agent's SIGINT handler prints a \"stopping\" line and "
        "exits 130. The agent cannot timestamp the signal itself, so *API → agent process gone* is reported as an "
        "upper bound of *API → agent sees the stop signal*: it adds the handler, a session-file write and "
        "interpreter exit (the raw floor below shows how much). "
        f"The \"stopping\" line reached the portal in {c['stopping_line_seen']} of {doc['trials']} trials; "
        f"{c['escalated']} needed SIGKILL.",
        "- **Stop-ignoring agent** (`@ignore-stop`, `@grandchild 300`, `@escape 300`, `@sleep 300`): the agent "
        "ignores SIGINT, its grandchild stays in the group, the escaped child has called `setsid()` before the "
        "interrupt is sent. *All gone* is the last of the three pids to disappear. An *orphan* is any of them "
        "still alive 1 s after the portal settled the turn.",
        "- **Raw floor**, same run: the scripted agent spawned directly (`start_new_session=True`); "
        "`os.killpg(SIGINT)` → the cooperative agent exited, and `os.killpg(SIGKILL)` → the stop-ignoring agent "
        "and its grandchild gone. The escaped child is not in the group: a bare `killpg` leaves it running "
        f"({r['escaped_orphans']} of {doc['trials']} raw trials) — why the daemon samples the process tree.", "",
        "| measure | p50 | p95 | max | n |", "|---|---:|---:|---:|---:|",
        row("cooperative: API → interrupt command stored", c["api_to_command_created_stored_ms"]),
        row("cooperative: API answered", c["api_response_ms"]),
        row("cooperative: API → command handed to the daemon's socket", c["api_to_command_delivered_stored_ms"]),
        row("cooperative: API → daemon's ack stored", c["api_to_command_acked_stored_ms"]),
        row("cooperative: API → agent gone (≥ sees SIGINT)", c["api_to_agent_gone_ms"]),
        row("cooperative: API → `signalled` stored", c["api_to_signalled_stored_ms"]),
        row("cooperative: API → `confirmed` stored", c["api_to_confirmed_stored_ms"]),
        row("stop-ignoring: API answered", d["api_response_ms"]),
        row("stop-ignoring: API → `signalled` stored", d["api_to_signalled_stored_ms"]),
        row("stop-ignoring: API → `escalated` stored", d["api_to_escalated_stored_ms"]),
        row("stop-ignoring: API → agent gone", d["api_to_agent_gone_ms"]),
        row("stop-ignoring: API → grandchild gone", d["api_to_grandchild_gone_ms"]),
        row("stop-ignoring: API → escaped child gone", d["api_to_escaped_gone_ms"]),
        row("stop-ignoring: API → all three gone", d["api_to_all_gone_ms"]),
        row("stop-ignoring: API → `confirmed` stored", d["api_to_confirmed_stored_ms"]),
        row("raw: `killpg(SIGINT)` → cooperative agent exited", r["sigint_to_exit_ms"]),
        row("raw: `killpg(SIGKILL)` → agent + grandchild gone", r["sigkill_to_group_gone_ms"]),
        "",
        f"- Orphans (stop-ignoring, via the portal): {d['orphans']} in {doc['trials']} trials; raw `killpg`: "
        f"{r['escaped_orphans']} escaped children left in {doc['trials']} trials.",
        f"- Ratio, cooperative API → agent gone over raw `killpg(SIGINT)` → exit (p50): "
        f"{doc['ratio_cooperative_to_raw_sigint_p50']}. Most of the path is the portal (the request's "
        "transaction, the push through Redis) and the WebSocket hop to the daemon: its ack is stored at "
        f"{c['api_to_command_acked_stored_ms'].get('p50')} ms (p50).",
        f"- Stop-ignoring: all gone = the command's way to the daemon + the {timeout} s grace period (counted from "
        "the daemon's receipt) + SIGKILL and its confirmation; "
        f"{over(d['api_to_all_gone_ms'].get('p50'))} over the timeout at p50, "
        f"{over(d['api_to_all_gone_ms'].get('max'))} at worst, against the 1 s allowed.",
        f"- Turn outcomes: cooperative {', '.join(c['outcomes'])}; stop-ignoring {', '.join(d['outcomes'])}.",
        "- Prefect's process worker: **not compared**. It would add Prefect (a heavy dependency with a server of "
        "its own) to the project for one benchmark; left for later.", "",
        f"- p50 API → stop signal ≤ 300 ms (upper bound above): {yes(v['p50_to_stop_signal_le_300ms'])}",
        f"- Stop-ignoring agent and all descendants gone ≤ {timeout} s + 1 s in every trial: "
        f"{yes(v['all_gone_le_timeout_plus_1s'])}",
        f"- 0 orphans: {yes(v['zero_orphans'])}",
        f"- 50 trials: {yes(v['fifty_trials'])}",
        "- Prefect comparison: not done",
        f"- **P2 met (without the Prefect comparison): {'yes' if v['met'] else 'no'}**",
    ]
    return "\n".join(lines) + "\n"


def docs_write(section: str) -> None:
    text = DOCS.read_text() if DOCS.exists() else (
        "# Benchmarks\n\nFigures for the quality targets of SPEC §11, each produced by a script in `bench/` on "
        "loopback; the exact command is given with each table.\n\n")
    start = text.find(SECTION + "\n")
    if start >= 0:
        # Up to the next section, or to the real-CLI part (bench/p2_real_cli.py writes that one).
        ends = [i for i in (text.find("\n## ", start + len(SECTION)), text.find("\n### P2 with real", start))
                if i >= 0]
        following = min(ends) if ends else -1
        text = text[:start] + section + ("" if following < 0 else "\n" + text[following + 1:])
    else:  # before the first section of a later target (P3, P4, …), else at the end
        later = re.search(r"^## (P[3-9]|R\d)", text, flags=re.M)
        if later:
            text = text[:later.start()] + section + "\n" + text[later.start():]
        else:
            text = text.rstrip("\n") + "\n\n" + section
    DOCS.write_text(text.rstrip("\n") + "\n")


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=50, help="measured trials of each variant (default 50)")
    p.add_argument("--warmups", type=int, default=1, help="unmeasured trials first (default 1)")
    p.add_argument("--sigint-timeout", type=int, default=2, dest="sigint_timeout_s",
                   help="the connection's and daemon's sigint_timeout_s (default 2)")
    p.add_argument("--database-url", default="postgres://root@127.0.0.1:5432/chorus_bench_p2",
                   help="bench database (created and dropped by this script via the server's `postgres` db)")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the daphne/celery/daemon logs")
    p.add_argument("--backend", choices=["scripted", "claude_code"], default="scripted",
                   help="claude_code: the real Claude Code against a hanging model server (bench/p2_real_cli.py; "
                        "its own part of the P2 section)")
    args = p.parse_args(argv)
    if args.trials < 1 or args.warmups < 0 or args.sigint_timeout_s < 1:
        p.error("--trials and --sigint-timeout must be at least 1, --warmups at least 0")
    return args


def on_sigterm(signum, frame):
    raise KeyboardInterrupt


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f} ms"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend == "claude_code":
        import p2_real_cli

        return p2_real_cli.run(args)
    command = ".venv/bin/python bench/interrupt_latency.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv) if a != "--no-docs")
    signal.signal(signal.SIGTERM, on_sigterm)  # unwinds through the finally below, as Ctrl-C does
    tmp = Path(tempfile.mkdtemp(prefix="chorus-bench-p2-"))
    (tmp / "raw").mkdir()
    stack = bench = None
    doc: dict = {"target": "P2", "date": dt.date.today().isoformat(), "command": command, "trials": args.trials,
                 "warmups": args.warmups, "sigint_timeout_s": args.sigint_timeout_s,
                 "load_average": {"start": round(os.getloadavg()[0], 2)}}
    coop, deaf, raw_int, raw_kill = [], [], [], []
    log(f"creating database {admin_url(args.database_url)[1]}; logs in {tmp}")
    database_recreate(args.database_url)
    redis_flush()
    try:
        django_setup(args.database_url)
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Group
        from django.core.management import call_command

        from chorus_site.permissions import OPERATOR
        from chorus_site.tokens import token_create
        from sessions_app.services import connection_register

        call_command("migrate", verbosity=0, interactive=False)
        doc["versions"] = versions(args.database_url)
        user = get_user_model().objects.create_user("bench-operator", "bench@example.invalid", None, is_staff=True)
        user.groups.add(Group.objects.get(name=OPERATOR))
        _token, raw_token = token_create(user=user, name="bench-p2")
        stack = Stack(tmp, args.database_url, args.sigint_timeout_s)
        connection, key = connection_register(name="bench-p2", backend="scripted", cwds=[str(stack.workspace)],
                                              sigint_timeout_s=args.sigint_timeout_s)
        log("starting daphne, the Celery worker and the daemon")
        stack.start_portal()
        stack.start_celery()
        stack.start_daemon(key, connection.pk)
        bench = Bench(stack, Api(stack.url, raw_token), connection.pk, args.sigint_timeout_s)

        for i in range(args.warmups + args.trials):
            c, d = bench.cooperative(), bench.stop_ignoring()
            ri, rk = raw_sigint(tmp), raw_sigkill(tmp, bench.leftovers)
            label = f"warm-up {i + 1}"
            if i >= args.warmups:
                label = f"trial {i - args.warmups + 1}/{args.trials}"
                coop.append(c)
                deaf.append(d)
                raw_int.append(ri)
                raw_kill.append(rk)
            log(f"{label}: cooperative gone {ms(c['agent_gone_ms'])}; stop-ignoring all gone "
                f"{ms(d['all_gone_ms'])}, orphans {d['orphans']}; raw SIGINT {ms(ri['exit_ms'])}, "
                f"raw SIGKILL {ms(rk['group_gone_ms'])}")
        doc["load_average"]["end"] = round(os.getloadavg()[0], 2)
        summarise(doc, coop, deaf, raw_int, raw_kill)
    except Unmeasurable as exc:
        log(f"cannot measure: {exc}")
        if stack is not None:
            for name in ("daemon", "celery", "daphne"):
                log(f"--- {name} log (tail) ---\n{stack.log_tail(name)}")
        return 2
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        return 130
    finally:
        if stack is not None:
            stack.stop()
        if bench is not None:
            for ident in bench.leftovers:
                kill_verified(ident)
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # noqa: BLE001 — Django may not be set up yet
            pass
        database_recreate(args.database_url, drop_only=True)
        redis_flush()
        if args.keep_logs:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        log("stopped the stack, dropped the bench database")
    print(json.dumps(doc, indent=2))
    if not args.no_docs:
        docs_write(docs_section(doc))
        log(f"wrote the P2 section of {DOCS.relative_to(ROOT)}")
    return 0  # a missed target is a finding reported in the JSON and the docs, not a crash


if __name__ == "__main__":
    sys.exit(main())
