"""P2 with the real Claude Code (``bench/interrupt_latency.py --backend claude_code``).

The same stack as the scripted mode (daphne, a Celery worker with beat, PostgreSQL, Redis), but the
daemon runs ``--backend claude_code`` with the pinned Claude Code from ``make agent-clis``
(``.agents-cli/``, or ``$CHORUS_AGENT_CLI_DIR``) against a model server of this script on loopback
that starts every reply and then hangs (the turn is mid-stream when it is stopped). Per trial,
interleaved:

* *cooperative*: a new session; when the model has been called, ``POST /turns/{id}/interrupt``.
  Measured: API → every process of the CLI's tree gone (the process group at the interrupt: the
  native binary and what it started), and the portal's stored stop stages.
* *stop-ignoring*: the daemon user's ``~/.claude/settings.json`` has a SessionEnd hook that ignores
  SIGINT/SIGTERM and sleeps: Claude Code 2.1.328 answers the SIGINT but waits for its hooks, so it
  does not exit; the daemon kills the tree after ``sigint_timeout_s``. Measured: API → the CLI gone,
  → the hook gone, → all gone, and orphans (anything alive 1 s after the portal settled the turn).

Figures go to the "P2 with real Claude Code" part of the P2 section of docs/benchmarks.md.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import interrupt_latency as p2
from benchdb import admin_url, database_recreate

SUBSECTION = "### P2 with real Claude Code"
HOOK = "#!/bin/sh\ntrap '' INT TERM\necho $$ > {pid_file}\nsleep 300\n"


class HangingModel:
    """Anthropic Messages on loopback: each streamed reply starts ("Thinking") and then hangs until
    closed; side requests (count_tokens, non-streamed) get a short answer. ``calls`` counts replies."""

    def __init__(self):
        self.calls = 0
        self.closing = threading.Event()
        model = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not body.get("stream"):
                    data = json.dumps({"id": "msg_b", "type": "message", "role": "assistant", "model": "m",
                                       "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                                       "input_tokens": 1, "usage": {"input_tokens": 1, "output_tokens": 1}}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                model.calls += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for event, data in (
                        ("message_start", {"type": "message_start", "message": {
                            "id": "msg_h", "type": "message", "role": "assistant", "model": body.get("model", "m"),
                            "content": [], "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 1}}}),
                        ("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}}),
                        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": "Thinking"}})):
                    try:
                        self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
                        self.wfile.flush()
                    except OSError:
                        return
                model.closing.wait(3600)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def claude_binary() -> tuple[str, str]:
    base = Path(os.environ.get("CHORUS_AGENT_CLI_DIR") or p2.ROOT / ".agents-cli")
    path = base / "node_modules" / ".bin" / "claude"
    if not path.exists():
        raise p2.Unmeasurable(f"{path} is missing: run `make agent-clis`")
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    return str(path), out


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live process of a process group."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                found.append((int(entry), fields[19]))
    return found


class ClaudeStack(p2.Stack):
    def __init__(self, tmp: Path, database_url: str, sigint_timeout_s: int, binary: str, model_url: str):
        super().__init__(tmp, database_url, sigint_timeout_s)
        self.binary, self.model_url = binary, model_url
        self.home = tmp / "home"
        (self.home / ".claude").mkdir(parents=True)

    def start_daemon(self, key: str, connection_id) -> None:
        from sessions_app.models import Connection

        env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "ANTHROPIC_AUTH_TOKEN"}}
        env.update(CHORUS_DATA_DIR=str(self.tmp / "daemon-data"), HOME=str(self.home), CHORUS_CLAUDE_CODE_BIN=self.binary,
                   ANTHROPIC_BASE_URL=self.model_url, ANTHROPIC_API_KEY="bench-key", DISABLE_AUTOUPDATER="1",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        self.daemon = self.spawn("daemon", [
            sys.executable, "manage.py", "chorus_daemon", "--portal", self.url, "--key", key,
            "--cwd", str(self.workspace), "--backend", "claude_code", "--sigint-timeout", str(self.sigint_timeout_s),
            "--spool-dir", str(self.tmp / "spool")], env)
        p2.wait_until(lambda: self.daemon.poll() is None and Connection.objects.filter(
            pk=connection_id, status="online", last_heartbeat_at__isnull=False).exists(),
            timeout=60, message="the daemon to come online", interval=0.1)

    def stubborn_hook(self, on: bool) -> Path:
        """Install (or remove) the SessionEnd hook that ignores the stop; returns its pid file."""
        pid_file = self.tmp / "hook.pid"
        pid_file.unlink(missing_ok=True)
        self.hook_on = on
        settings = self.home / ".claude" / "settings.json"
        if not on:
            settings.unlink(missing_ok=True)
            return pid_file
        hook = self.tmp / "session-end-hook.sh"
        hook.write_text(HOOK.format(pid_file=pid_file))
        hook.chmod(0o755)
        settings.write_text(json.dumps({"hooks": {"SessionEnd": [{"matcher": "", "hooks": [
            {"type": "command", "command": str(hook), "timeout": 300}]}]}}))
        return pid_file


class ClaudeBench(p2.Bench):
    def __init__(self, stack: ClaudeStack, api, connection_id, sigint_timeout_s: int, model: HangingModel):
        super().__init__(stack, api, connection_id, sigint_timeout_s)
        self.model = model

    def running_cli(self, turn_id: str) -> list[tuple[int, str]]:
        """The CLI's process group once it runs and the model has been called (mid-stream)."""
        from sessions_app.models import Turn

        calls = self.model.calls
        pid = p2.wait_until(lambda: Turn.objects.filter(pk=turn_id, status="running").values_list(
            "pid", flat=True).first(), timeout=60, message=f"turn {turn_id} to run")
        p2.wait_until(lambda: self.model.calls > calls, timeout=60, message="Claude Code to call the model")
        members = group_members(pid)
        if not members:
            raise p2.Unmeasurable(f"the CLI of turn {turn_id} is already gone")
        self.leftovers.extend(members)
        return members

    def trial(self, stubborn: bool) -> dict:
        pid_file = self.stack.stubborn_hook(stubborn)
        turn_id, session_id = self.start_turn("Think about it for a long time.")
        members = self.running_cli(turn_id)
        pids = {f"cli:{pid}": ident for pid, ident in zip((m[0] for m in members), members)}
        if stubborn:  # the hook starts only after the SIGINT: learnt while the stop runs
            watcher = threading.Thread(target=self._watch_hook, args=(pid_file, pids), daemon=True)
            watcher.start()
        run = self.interrupt_polling(turn_id, pids)
        settled = self.settle(turn_id, session_id, run["t0_wall"])
        time.sleep(p2.ORPHAN_CHECK_S)  # the measurement's own wait: what still lives 1 s after settling
        hook = pids.get("hook")  # learnt by the watcher while the stop ran
        orphans = [ident for ident in pids.values() if p2.alive(ident)]
        for ident in orphans:
            p2.kill_verified(ident)
        gone = run["gone_ms"]
        cli_gone = [v for k, v in gone.items() if k.startswith("cli:")]
        hook_gone = gone.get("hook")
        complete = len(cli_gone) == len(members) and (not stubborn or hook_gone is not None)
        return {"response_ms": run["response_ms"], "cli_gone_ms": max(cli_gone) if cli_gone else None,
                "hook_gone_ms": hook_gone, "all_gone_ms": max(gone.values()) if complete else None,
                "processes": len(members), "hook_seen": hook is not None,
                **{f"{k}_ms": settled["stages"].get(k) for k in p2.COMMAND_STAGES},
                "signalled_ms": settled["stages"].get("signalled"), "escalated_ms": settled["stages"].get("escalated"),
                "confirmed_ms": settled["stages"].get("confirmed"),
                "outcome": f"{settled['status']}({settled['reason']}) stop {settled['stop_state']}",
                "orphans": len(orphans)}

    def interrupt_polling(self, turn_id: str, pids: dict) -> dict:
        """As ``Bench.interrupt``, but ``pids`` may grow while the stop runs (the hook appears)."""
        answer: dict = {}

        def call():
            answer["result"] = self.api.call("POST", f"/turns/{turn_id}/interrupt", {"reason": "bench P2"})
            answer["ms"] = (time.perf_counter() - t0) * 1000

        thread = threading.Thread(target=call, name="interrupt", daemon=True)
        t0_wall, t0 = time.time(), time.perf_counter()
        thread.start()
        gone: dict = {}
        deadline = t0 + self.timeout_s + 10
        while time.perf_counter() < deadline:
            pending = {k: v for k, v in list(pids.items()) if k not in gone}
            if not pending and ("hook" in pids or not self.stack.hook_on):
                break  # everything seen is gone (the hook too, when there is one)
            for name, ident in pending.items():
                if not p2.alive(ident):
                    gone[name] = (time.perf_counter() - t0) * 1000
            time.sleep(p2.POLL_S)
        thread.join(30)
        status, body = answer.get("result", (None, {}))
        if status != 200 or not body.get("dispatched"):
            raise p2.Unmeasurable(f"interrupt of {turn_id} answered {status}: {body}")
        return {"t0_wall": t0_wall, "response_ms": answer["ms"], "gone_ms": gone}

    def _hook_ident(self, pid_file: Path):
        try:
            return p2.identify(int(pid_file.read_text()))
        except (OSError, ValueError, p2.Unmeasurable):
            return None

    def _watch_hook(self, pid_file: Path, pids: dict) -> None:
        """Add the hook to the pids the interrupt polls as soon as it has written its pid."""
        deadline = time.monotonic() + self.timeout_s + 10
        while time.monotonic() < deadline:
            hook = self._hook_ident(pid_file)
            if hook:
                self.leftovers.append(hook)
                pids["hook"] = hook
                return
            time.sleep(p2.POLL_S)


def run(args) -> int:
    command = ".venv/bin/python bench/interrupt_latency.py" + "".join(
        f" {shlex.quote(a)}" for a in sys.argv[1:] if a != "--no-docs")
    signal.signal(signal.SIGTERM, p2.on_sigterm)
    binary, cli_version = claude_binary()
    tmp = Path(tempfile.mkdtemp(prefix="chorus-bench-p2-claude-"))
    model = HangingModel()
    stack = bench = None
    doc: dict = {"target": "P2", "backend": "claude_code", "cli": cli_version, "date": dt.date.today().isoformat(),
                 "command": command, "trials": args.trials, "warmups": args.warmups,
                 "sigint_timeout_s": args.sigint_timeout_s, "load_average": {"start": round(os.getloadavg()[0], 2)}}
    coop, deaf = [], []
    p2.log(f"creating database {admin_url(args.database_url)[1]}; logs in {tmp}")
    database_recreate(args.database_url)
    p2.redis_flush()
    try:
        p2.django_setup(args.database_url)
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Group
        from django.core.management import call_command

        from chorus_site.permissions import OPERATOR
        from chorus_site.tokens import token_create
        from sessions_app.services import connection_register

        call_command("migrate", verbosity=0, interactive=False)
        doc["versions"] = p2.versions(args.database_url)
        user = get_user_model().objects.create_user("bench-operator", "bench@example.invalid", None, is_staff=True)
        user.groups.add(Group.objects.get(name=OPERATOR))
        _token, raw_token = token_create(user=user, name="bench-p2")
        stack = ClaudeStack(tmp, args.database_url, args.sigint_timeout_s, binary, model.url)
        connection, key = connection_register(name="bench-p2-claude", backend="claude_code",
                                              cwds=[str(stack.workspace)], sigint_timeout_s=args.sigint_timeout_s)
        p2.log(f"starting daphne, the Celery worker and the daemon with {cli_version}")
        stack.start_portal()
        stack.start_celery()
        stack.start_daemon(key, connection.pk)
        bench = ClaudeBench(stack, p2.Api(stack.url, raw_token), connection.pk, args.sigint_timeout_s, model)
        for i in range(args.warmups + args.trials):
            c, d = bench.trial(stubborn=False), bench.trial(stubborn=True)
            label = f"warm-up {i + 1}" if i < args.warmups else f"trial {i - args.warmups + 1}/{args.trials}"
            if i >= args.warmups:
                coop.append(c)
                deaf.append(d)
            p2.log(f"{label}: cooperative CLI tree gone {p2.ms(c['all_gone_ms'])}; stop-ignoring all gone "
                   f"{p2.ms(d['all_gone_ms'])}, orphans {d['orphans']}")
        doc["load_average"]["end"] = round(os.getloadavg()[0], 2)
        summarise(doc, coop, deaf)
    except p2.Unmeasurable as exc:
        p2.log(f"cannot measure: {exc}")
        if stack is not None:
            for name in ("daemon", "celery", "daphne"):
                p2.log(f"--- {name} log (tail) ---\n{stack.log_tail(name)}")
        return 2
    except KeyboardInterrupt:
        p2.log("interrupted: cleaning up")
        return 130
    finally:
        if stack is not None:
            stack.stop()
        if bench is not None:
            for ident in bench.leftovers:
                p2.kill_verified(ident)
        model.close()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # noqa: BLE001 — Django may not be set up yet
            pass
        database_recreate(args.database_url, drop_only=True)
        p2.redis_flush()
        if args.keep_logs:
            p2.log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        p2.log("stopped the stack, dropped the bench database")
    print(json.dumps(doc, indent=2))
    if not args.no_docs:
        docs_write(docs_section(doc))
        p2.log(f"wrote the '{SUBSECTION}' part of {p2.DOCS.relative_to(p2.ROOT)}")
    return 0


def summarise(doc: dict, coop: list[dict], deaf: list[dict]) -> None:
    limit_ms = (doc["sigint_timeout_s"] + p2.GONE_MARGIN_S) * 1000

    def part(trials: list[dict]) -> dict:
        keys = ("response_ms", "command_created_ms", "command_acked_ms", "cli_gone_ms", "hook_gone_ms",
                "all_gone_ms", "signalled_ms", "escalated_ms", "confirmed_ms")
        return {**{k: p2.stats([t[k] for t in trials]) for k in keys},
                "processes": sorted({t["processes"] for t in trials}), "orphans": sum(t["orphans"] for t in trials),
                "escalated": sum(t["escalated_ms"] is not None for t in trials),
                "outcomes": sorted({t["outcome"] for t in trials})}

    doc["cooperative"], doc["stop_ignoring"] = part(coop), part(deaf)
    deaf_all = [t["all_gone_ms"] for t in deaf]
    doc["stop_ignoring"]["over_limit"] = sum(1 for v in deaf_all if v is None or v > limit_ms)
    doc["stop_ignoring"]["hook_seen"] = sum(t["hook_seen"] for t in deaf)
    doc["verdict"] = {"cooperative_gone_p50_le_300ms": (doc["cooperative"]["all_gone_ms"].get("p50") or 1e9) <= 300,
                      "all_gone_le_timeout_plus_1s": doc["stop_ignoring"]["over_limit"] == 0,
                      "zero_orphans": doc["cooperative"]["orphans"] + doc["stop_ignoring"]["orphans"] == 0}


def docs_section(doc: dict) -> str:
    def row(label: str, s: dict) -> str:
        if not s.get("n"):
            return f"| {label} | – | – | – | 0 |"
        missing = f" ({s['missing']} missing)" if s.get("missing") else ""
        return f"| {label} | {s['p50']:.1f} | {s['p95']:.1f} | {s['max']:.1f} | {s['n']}{missing} |"

    c, d, v, m = doc["cooperative"], doc["stop_ignoring"], doc["verdict"], doc["versions"]
    timeout = doc["sigint_timeout_s"]
    yes = {True: "yes", False: "**no**"}
    lines = [
        SUBSECTION, "",
        f"The same targets with the real CLI: Claude Code {doc['cli'].split()[0]} (the Makefile's pin) run by `chorus_daemon --backend "
        f"claude_code --sigint-timeout {timeout}` against a loopback model server of the script that starts every "
        f"reply and then hangs (the turn is mid-stream when stopped). Measured {doc['date']} on {m['cpus']} cores; "
        f"code at {m['commit']}" + (" plus uncommitted changes" if m["uncommitted"] else "") +
        f"; load average {doc['load_average']['start']} at the start, {doc['load_average']['end']} at the end "
        "(other test suites shared the machine). Command:", "",
        "```", doc["command"], "```", "",
        f"{doc['trials']} trials of each after {doc['warmups']} warm-up, interleaved. *CLI tree gone*: every process "
        f"of the CLI's process group at the interrupt ({' or '.join(map(str, c['processes']))} here: the native "
        "binary; its Bash tools would run in sessions of their own, and none runs). *Stop-ignoring*: a SessionEnd hook "
        "in `~/.claude/settings.json` that ignores SIGINT/SIGTERM and sleeps; Claude Code answers the SIGINT but "
        f"waits for its hooks, so only the daemon's kill after {timeout} s ends it (hook seen in "
        f"{d['hook_seen']} of {doc['trials']} trials; it starts after the SIGINT).", "",
        "| measure (ms from the API call) | p50 | p95 | max | n |", "|---|---:|---:|---:|---:|",
        row("cooperative: API answered", c["response_ms"]),
        row("cooperative: API → daemon's ack stored", c["command_acked_ms"]),
        row("cooperative: API → CLI tree gone", c["all_gone_ms"]),
        row("cooperative: API → `confirmed` stored", c["confirmed_ms"]),
        row("stop-ignoring: API → `escalated` stored", d["escalated_ms"]),
        row("stop-ignoring: API → CLI gone", d["cli_gone_ms"]),
        row("stop-ignoring: API → hook gone", d["hook_gone_ms"]),
        row("stop-ignoring: API → all gone", d["all_gone_ms"]),
        row("stop-ignoring: API → `confirmed` stored", d["confirmed_ms"]),
        "",
        f"- Turn outcomes: cooperative {', '.join(c['outcomes'])} ({c['escalated']} needed SIGKILL); "
        f"stop-ignoring {', '.join(d['outcomes'])} ({d['escalated']} escalated).",
        f"- Orphans (alive 1 s after the portal settled the turn): cooperative {c['orphans']}, stop-ignoring "
        f"{d['orphans']}.",
        f"- API → CLI tree gone p50 ≤ 300 ms: {yes[v['cooperative_gone_p50_le_300ms']]}",
        f"- Stop-ignoring CLI and its hook gone ≤ {timeout} s + 1 s in every trial: "
        f"{yes[v['all_gone_le_timeout_plus_1s']]}",
        f"- 0 orphans: {yes[v['zero_orphans']]}",
    ]
    return "\n".join(lines) + "\n"


def docs_write(section: str) -> None:
    """Replace this subsection inside the P2 section (or add it at the P2 section's end)."""
    text = p2.DOCS.read_text()
    start = text.find(SUBSECTION + "\n")
    if start < 0:
        p2_start = text.find(p2.SECTION + "\n")
        if p2_start < 0:
            raise SystemExit(f"no '{p2.SECTION}' section in {p2.DOCS}")
        end = text.find("\n## ", p2_start + len(p2.SECTION))
        end = len(text) if end < 0 else end + 1
        text = text[:end].rstrip("\n") + "\n\n" + section + ("\n" + text[end:] if end < len(text) else "")
    else:
        ends = [i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i >= 0]
        end = min(ends) + 1 if ends else len(text)
        text = text[:start] + section + ("\n" + text[end:] if end < len(text) else "")
    p2.DOCS.write_text(text.rstrip("\n") + "\n")
