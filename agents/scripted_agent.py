"""The bundled scripted agent (SPEC §5, §5.1): every path of the spec, reproducible without an LLM.

    python -m agents.scripted_agent [--resume SESSION_ID]  < prompt

It reads the whole prompt from stdin, works in the current directory and writes one JSON object
per line to stdout, flushed at once: the output the ``scripted`` backend parses. It imports only
the standard library, because it runs on agent machines next to the daemon.

Sessions live in ``$CHORUS_SCRIPTED_HOME`` (default ``~/.chorus/scripted``) as ``<id>.json``
holding the conversation; ``--resume`` loads one and appends to it, so a conversation continues.

Output lines (``type`` then the event's fields)::

    {"type":"session","id":"…"}                              first line of every run
    {"type":"progress","message":"turn 2","turn":2,"resumed":true}
    {"type":"progress","message":"…", …}                     also grandchild_pid/escape_pid/background_pid
    {"type":"text","text":"…"}        {"type":"final","text":"…"}
    {"type":"tool","name":"write","input":{"path":"a.txt","bytes":3}}
    {"type":"usage","input":12,"output":3,"cache_read":0,"cache_write":0}
    {"type":"requires_action","kind":"confirmation|external_execution","items":[{"id":"…","text":"…"}]}
    {"type":"outcome","intent":"succeeded","ref":"…"}
    {"type":"member","key":"…","prompt":"…"}  {"type":"comment","text":"…"}  {"type":"artifact","name":"…","text":"…"}
    {"type":"error","message":"…"}

Directives, one per prompt line, run in order; every other line is the message. See the table in
``docs/daemon-backends.md``. Exit codes: 0 done (also when the turn waits in requires_action),
130 stopped by SIGINT/SIGTERM, 127 ``@fail-start``, 2 a refused or malformed directive,
1 an unknown ``--resume`` session, and whatever ``@exit`` / ``@signal`` ask for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

DIRECTIVES = (
    "reply", "sleep", "write", "stderr", "exit", "signal", "ignore-stop", "grandchild", "escape",
    "background", "fail-start", "require-approval", "await-tool", "outcome", "member", "comment",
    "artifact", "usage", "cat", "stderr-file", "silent", "wait-child",
)
FILE_REF = re.compile(r"\{(file|env):([^{}]+)\}")
OUTCOME_INTENTS = ("succeeded", "failed", "blocked", "waiting")
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
EXIT_STOPPED, EXIT_FAIL_START, EXIT_REFUSED, EXIT_UNKNOWN_SESSION = 130, 127, 2, 1
ACTION_KINDS = {"require-approval": "confirmation", "await-tool": "external_execution"}


class Stopped(Exception):
    """Raised by the SIGINT/SIGTERM handler: the agent was asked to stop."""


class Refused(Exception):
    """A directive that cannot be carried out (bad argument, path outside the cwd)."""


# ------------------------------------------------------------------------------------------ output

def emit(event_type: str, /, **data) -> None:
    line = json.dumps({"type": event_type, **data}, separators=(",", ":"), default=str)
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        # The reader went away: the work goes on (an observer leaving is never a failure).
        sys.stdout = open(os.devnull, "w")


def progress(message: str, **extra) -> None:
    emit("progress", message=message, **extra)


# ---------------------------------------------------------------------------------------- sessions

def scripted_home() -> str:
    return os.environ.get("CHORUS_SCRIPTED_HOME") or os.path.join(os.path.expanduser("~"), ".chorus", "scripted")


def session_path(session_id: str) -> str:
    return os.path.join(scripted_home(), f"{session_id}.json")


def session_load(session_id: str) -> dict | None:
    if not SESSION_ID_RE.match(session_id):
        return None
    try:
        with open(session_path(session_id), encoding="utf-8") as fh:
            session = json.load(fh)
    except (OSError, ValueError):
        return None
    return session if isinstance(session, dict) and isinstance(session.get("messages"), list) else None


def session_save(session: dict) -> None:
    os.makedirs(scripted_home(), exist_ok=True)
    session["updated_at"] = time.time()
    path = session_path(session["id"])
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(session, fh, indent=1)
    os.replace(tmp, path)


def session_new(cwd: str) -> dict:
    now = time.time()
    return {"id": str(uuid.uuid4()), "cwd": cwd, "created_at": now, "updated_at": now, "turns": 0,
            "messages": [], "pending": None}


# -------------------------------------------------------------------------------------- directives

def parse_prompt(prompt: str) -> tuple[list[tuple[str, str]], str]:
    """(directives as (name, argument) in order, the message made of every other line)."""
    steps, message = [], []
    for line in prompt.splitlines():
        stripped = line.strip()
        if stripped.startswith("@"):
            name, _, arg = stripped[1:].partition(" ")
            if name in DIRECTIVES:
                steps.append((name, arg.strip()))
                continue
        message.append(line)
    return steps, "\n".join(message).strip()


def number(arg: str, directive: str, *, integer: bool = False, minimum: float = 0) -> float:
    try:
        value = int(arg) if integer else float(arg)
    except ValueError:
        raise Refused(f"@{directive} needs a number, got {arg!r}") from None
    if value < minimum or value != value or value == float("inf"):
        raise Refused(f"@{directive} needs a number >= {minimum}, got {arg!r}")
    return value


def signal_from_name(arg: str) -> signal.Signals:
    name = arg.strip().upper()
    try:
        return signal.Signals(int(name)) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise Refused(f"@signal: unknown signal {arg!r}") from None


def sleeper(seconds: float, *, leave_group: bool = False) -> list[str]:
    code = f"import time; time.sleep({seconds!r})"
    if leave_group:
        code = "import os; os.setsid(); " + code
    return [sys.executable, "-c", code]


def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    # Stdio goes to /dev/null so a leftover child never holds the daemon's output pipes open.
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True, **kwargs)


def api_post(path: str, body: dict, what: str) -> None:
    """POST to the portal with the task token when CHORUS_API_URL/CHORUS_TASK_TOKEN are set.

    Best effort: a failure is reported as a progress line, never raised.
    """
    api, token = os.environ.get("CHORUS_API_URL"), os.environ.get("CHORUS_TASK_TOKEN")
    if not api or not token:
        return
    request = urllib.request.Request(
        api.rstrip("/") + path, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                 "Idempotency-Key": str(uuid.uuid4())})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            result = f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        result = f"HTTP {exc.code}"
    except Exception as exc:  # noqa: BLE001 — best effort by design
        result = f"failed ({exc.__class__.__name__})"
    progress(f"{what} posted: {result}", posted=what, result=result)


def context_ids() -> dict:
    ids = {"issue": os.environ.get("CHORUS_ISSUE_ID"), "run": os.environ.get("CHORUS_RUN_ID"),
           "attempt": os.environ.get("CHORUS_ATTEMPT_ID")}
    return {k: v for k, v in ids.items() if v}


def expand(text: str, cwd: str) -> str:
    """``{file:PATH}`` replaced by that file's text (its last newline dropped), PATH relative to the
    cwd, and ``{env:NAME}`` by that environment variable: what the agent prints then need not be in
    its prompt (the canary suite's secrets, an agent printing its own task token)."""
    def read(match: re.Match) -> str:
        kind, name = match.groups()
        if kind == "env":
            return os.environ.get(name, "")
        try:
            with open(os.path.join(cwd, name), encoding="utf-8") as fh:
                return fh.read().removesuffix("\n")
        except OSError as exc:
            raise Refused(f"cannot read {name}: {exc.strerror}") from None

    return FILE_REF.sub(read, text)


class Turn:
    """One run of the agent: the directives of one prompt applied to one session."""

    def __init__(self, session: dict, prompt: str, steps: list[tuple[str, str]], message: str):
        self.cwd = os.path.realpath(os.getcwd())
        self.session, self.prompt, self.steps = session, prompt, steps
        self.message = expand(message, self.cwd)
        self.number = session["turns"]
        self.reply: list[str] = []
        self.usage_sent = False

    # Each directive returns None to go on, or an exit code to end the turn with.
    def run(self) -> int:
        index = 0
        while index < len(self.steps):
            name, arg = self.steps[index]
            arg = expand(arg, self.cwd)
            if name in ACTION_KINDS:
                group = [arg]
                while index + 1 < len(self.steps) and self.steps[index + 1][0] == name:
                    index += 1
                    group.append(expand(self.steps[index][1], self.cwd))
                return self.requires_action(ACTION_KINDS[name], group)
            code = getattr(self, "do_" + name.replace("-", "_"))(arg)
            if code is not None:
                return code
            index += 1
        return self.finish()

    def finish(self) -> int:
        reply = "\n".join(self.reply) if self.reply else (
            f"Acknowledged: {self.message[:200]}" if self.message else "Acknowledged.")
        self.session["messages"].append({"role": "assistant", "turn": self.number, "content": reply})
        session_save(self.session)
        emit("text", text=reply)
        emit("final", text=reply)
        self.send_default_usage(reply)
        return 0

    def send_default_usage(self, reply: str = "") -> None:
        if not self.usage_sent:
            emit("usage", input=max(1, len(self.prompt) // 4), output=max(1, len(reply) // 4),
                 cache_read=0, cache_write=0)
            self.usage_sent = True

    def requires_action(self, kind: str, texts: list[str]) -> int:
        items = [{"id": f"req-{self.number}-{i}", "text": text or kind} for i, text in enumerate(texts, 1)]
        self.session["pending"] = {"kind": kind, "items": items, "turn": self.number}
        self.session["messages"].append({"role": "assistant", "turn": self.number,
                                         "content": f"[waiting: {kind}] " + "; ".join(i["text"] for i in items)})
        session_save(self.session)
        emit("requires_action", kind=kind, items=items)
        self.send_default_usage()
        return 0

    def do_reply(self, arg: str) -> None:
        self.reply.append(arg or f"turn {self.number}")

    def do_sleep(self, arg: str) -> None:
        seconds = number(arg, "sleep")
        start = time.monotonic()
        end, tick = start + seconds, 1
        progress(f"working for {seconds:g} s", seconds=seconds)
        while (now := time.monotonic()) < end:
            if now - start >= tick:
                progress("working", elapsed_s=tick)
                tick += 1
            time.sleep(max(0.0, min(0.05, end - now, start + tick - now)))

    def do_silent(self, arg: str) -> None:
        """Print nothing for that long (a stalled agent, issue 12): no progress lines, no child."""
        end = time.monotonic() + number(arg, "silent")
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(0.05, left))

    def do_wait_child(self, arg: str) -> None:
        """Start a child that sleeps that long and wait for it silently (a tool call that blocks)."""
        seconds, _, extra = arg.partition(" ")  # words after the seconds: more arguments of its command line
        child = spawn(sleeper(number(seconds, "wait-child")) + extra.split())
        child.wait()

    def do_write(self, arg: str) -> None:
        path, _, text = arg.partition(" ")
        if not path:
            raise Refused("@write needs a path")
        target = os.path.realpath(os.path.join(self.cwd, path))
        if target == self.cwd or os.path.commonpath([self.cwd, target]) != self.cwd:
            raise Refused(f"refused to write outside the working directory: {path}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        data = (text + "\n").encode()
        with open(target, "wb") as fh:
            fh.write(data)
        emit("tool", name="write", input={"path": os.path.relpath(target, self.cwd), "bytes": len(data)})

    def do_stderr(self, arg: str) -> None:
        sys.stderr.write(arg + "\n")
        sys.stderr.flush()

    def _file_lines(self, arg: str, directive: str):
        if not arg:
            raise Refused(f"@{directive} needs a path")
        try:
            with open(os.path.join(self.cwd, arg), encoding="utf-8") as fh:
                return fh.readlines()
        except OSError as exc:
            raise Refused(f"@{directive}: cannot read {arg}: {exc.strerror}") from None

    def do_cat(self, arg: str) -> None:
        """The file's lines on stdout as they are (JSON lines are events, other lines raw text)."""
        for line in self._file_lines(arg, "cat"):
            sys.stdout.write(line if line.endswith("\n") else line + "\n")
            sys.stdout.flush()

    def do_stderr_file(self, arg: str) -> None:
        for line in self._file_lines(arg, "stderr-file"):
            sys.stderr.write(line if line.endswith("\n") else line + "\n")
        sys.stderr.flush()

    def do_exit(self, arg: str) -> int:
        code = int(number(arg, "exit", integer=True))
        if code == 0:
            return self.finish()
        session_save(self.session)
        return code % 256

    def do_signal(self, arg: str) -> None:
        sig = signal_from_name(arg)
        progress(f"sending myself {sig.name}", signal=sig.name)
        session_save(self.session)
        sys.stdout.flush()
        sys.stderr.flush()
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(0.2)  # a fatal signal ends the process here; one whose default is "ignore" goes on

    def do_ignore_stop(self, arg: str) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        progress("ignoring SIGINT and SIGTERM")

    def do_grandchild(self, arg: str) -> None:
        child = spawn(sleeper(number(arg, "grandchild")))
        progress("grandchild started", grandchild_pid=child.pid)

    def do_escape(self, arg: str) -> None:
        child = spawn(sleeper(number(arg, "escape"), leave_group=True))
        progress("escaping child started", escape_pid=child.pid)

    def do_background(self, arg: str) -> None:
        seconds, _, extra = arg.partition(" ")  # words after the seconds: more arguments of its command line
        child = spawn(sleeper(number(seconds, "background")) + extra.split(), start_new_session=True)
        progress("background process started", background_pid=child.pid)

    def do_fail_start(self, arg: str) -> None:  # handled before any output; here only for completeness
        return None

    def do_outcome(self, arg: str) -> None:
        intent, _, ref = arg.partition(" ")
        intent, ref = intent.lower(), ref.strip()
        if intent not in OUTCOME_INTENTS:
            raise Refused(f"@outcome needs one of {', '.join(OUTCOME_INTENTS)}, got {intent!r}")
        # The summary is the agent's own words (its replies so far), never the prompt it was given.
        summary = "\n".join(self.reply)[:500] or None
        body = {"intent": intent, **({"ref": ref} if ref else {}), "summary": summary}
        emit("outcome", **{k: v for k, v in body.items() if v is not None})
        attempt = os.environ.get("CHORUS_ATTEMPT_ID")
        if attempt:
            api_post(f"/attempts/{attempt}/outcome", {k: v for k, v in body.items() if v is not None}, "outcome")

    def do_member(self, arg: str) -> None:
        key, _, prompt = arg.partition(" ")
        if not key:
            raise Refused("@member needs a key")
        emit("member", key=key, prompt=prompt)
        run = os.environ.get("CHORUS_RUN_ID")
        if run:
            api_post(f"/runs/{run}/nodes", {"nodes": [{"key": key, "prompt": prompt}]}, "member")

    def do_comment(self, arg: str) -> None:
        emit("comment", text=arg)
        issue = os.environ.get("CHORUS_ISSUE_ID")
        if issue:
            api_post(f"/issues/{issue}/comments", {"type": "comment", "body": arg, **context_ids()}, "comment")

    def do_artifact(self, arg: str) -> None:
        name, _, text = arg.partition(" ")
        if not name:
            raise Refused("@artifact needs a name")
        emit("artifact", name=name, text=text)
        if context_ids():
            api_post("/artifacts", {"kind": "report", "name": name, "content": text, **context_ids()}, "artifact")

    def do_usage(self, arg: str) -> None:
        parts = arg.split()
        if len(parts) != 2:
            raise Refused("@usage needs two numbers: IN OUT")
        emit("usage", input=int(number(parts[0], "usage", integer=True)),
             output=int(number(parts[1], "usage", integer=True)), cache_read=0, cache_write=0)
        self.usage_sent = True


# -------------------------------------------------------------------------------------------- main

def on_stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def read_prompt() -> str:
    if sys.stdin is None:
        return ""
    if sys.stdin.isatty():
        sys.stderr.write("scripted agent: type the prompt, then Ctrl-D\n")
    return sys.stdin.buffer.read().decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.scripted_agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--resume", metavar="SESSION_ID", help="continue this session")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGTERM, on_stop)
    session = None
    try:
        prompt = read_prompt()
        steps, message = parse_prompt(prompt)
        if any(name == "fail-start" for name, _ in steps):
            sys.stderr.write("scripted agent: not logged in (credentials missing); run the login first\n")
            return EXIT_FAIL_START

        resumed = args.resume is not None
        session = session_load(args.resume) if resumed else session_new(os.path.realpath(os.getcwd()))
        if session is None:
            sys.stderr.write(f"scripted agent: no such session: {args.resume}\n")
            emit("error", message=f"no such session: {args.resume}")
            return EXIT_UNKNOWN_SESSION
        session["turns"] = session.get("turns", 0) + 1
        session["messages"].append({"role": "user", "turn": session["turns"], "content": prompt})
        pending, session["pending"] = session.get("pending"), None
        session_save(session)

        emit("session", id=session["id"])
        progress(f"turn {session['turns']}", turn=session["turns"], resumed=resumed)
        if pending:
            progress("answer received", answered=[item["id"] for item in pending.get("items", [])],
                     kind=pending.get("kind"), answer=message[:500])
        try:
            return Turn(session, prompt, steps, message).run()
        except Refused as exc:
            emit("error", message=str(exc))
            sys.stderr.write(f"scripted agent: {exc}\n")
            session_save(session)
            return EXIT_REFUSED
    except Stopped as exc:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second stop request ends it at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        progress("stopping", signal=str(exc))
        if session is not None:
            session["messages"].append({"role": "assistant", "turn": session["turns"], "content": "[stopped]"})
            session_save(session)
        return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
