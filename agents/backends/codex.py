"""Backend ``codex``: OpenAI Codex CLI in non-interactive mode with JSON Lines output.

    new:    codex exec --json --skip-git-repo-check --sandbox workspace-write --cd <cwd> [ARGS] -
    resume: codex exec --json --skip-git-repo-check --sandbox workspace-write --cd <cwd> [ARGS] resume <id> -

``-`` makes Codex read the prompt from stdin. ``exec`` is read-only by default, so the adapter asks
for the ``workspace-write`` sandbox; CHORUS_CODEX_ARGS adds options (e.g. ``--model``). Each
stdout line is one event:

* ``thread.started`` {thread_id} — the session id ``codex exec resume`` accepts;
* ``turn.started``; ``turn.completed`` {usage: input_tokens, cached_input_tokens, output_tokens};
  ``turn.failed`` {error: {message}}; ``error`` {message} (also transient reconnect notices);
* ``item.started`` / ``item.updated`` / ``item.completed`` {item: {id, type, …}} with item types
  ``agent_message`` {text}, ``reasoning`` {text}, ``command_execution`` {command,
  aggregated_output, exit_code, status}, ``file_change`` {changes: [{path, kind}], status},
  ``mcp_tool_call`` {server, tool, arguments, status}, ``web_search`` {query}, ``todo_list``
  {items}, ``error`` {message}. Older releases spell the item type ``item_type``.

Codex prints no separate final reply: after ``turn.completed`` the last agent message is the
final reply (``finish``). ``input`` usage excludes the cached part (Codex counts it inside
``input_tokens``). No protocol stop in exec mode: SIGINT ends the run.

Observed with 0.169.0 against tests/model_standin.py (docs/daemon-backends.md has the table):

* the provider comes from ``$CODEX_HOME/config.toml`` (``model_provider`` and a
  ``[model_providers.<name>]`` table with ``base_url``, ``wire_api = "responses"``, ``env_key``):
  the same mechanism points Codex at a company gateway;
* the model's tools are ``exec_command`` {cmd} (shell, in the ``workspace-write`` sandbox) and,
  for known model names, a freeform ``apply_patch`` custom tool; both show as items
  (``command_execution``, ``file_change``);
* an unknown model name prints an ``error`` *item* ("Model metadata for … not found") and goes
  on: a warning, not a failure;
* a refused API call: ``error`` "Reconnecting... 1/N (…)" per retry (``request_max_retries``; shown as
  "retrying: authentication failed (attempt 1 of N)", the turn's live "retrying" state),
  then ``error`` and ``turn.failed`` {error: {message: "unexpected status 401 Unauthorized: …"}},
  exit 1; a refused connection retries for ever ("Reconnecting... waiting for network") with a
  growing delay — the operator's stop ends it;
* ``exec resume <unknown id>``: nothing on stdout, ``Error: thread/resume: … no rollout found for
  thread id …`` on stderr, exit 1;
* SIGINT mid-stream: exit 1 at once, nothing printed after ``turn.started`` (a partial reply is
  lost; the thread id of ``thread.started`` stays valid for ``exec resume``). ``codex`` from npm is
  a Node launcher that forwards SIGINT/SIGTERM/SIGHUP to the native binary;
* ``turn.completed`` usage on a resumed thread is the thread's running total, not the turn's: on
  a resume the adapter reads the total so far from the thread's rollout file (the last
  ``token_count`` event) and reports the difference.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
from collections.abc import Mapping

from agents.protocol import EV_FINAL, EV_PROGRESS, EV_SESSION, EV_TEXT, EV_TOOL, EV_USAGE, AgentEvent

from .base import (
    UNREACHABLE_CAUSE,
    Backend,
    LaunchSpec,
    as_int,
    error_event,
    first,
    last_text,
    status_cause,
    summarise,
)

RECONNECT_RE = re.compile(r"reconnecting\.*\s*(\d+)\s*/\s*(\d+)", re.IGNORECASE)
TRANSIENT_RE = re.compile(r"reconnecting|retrying|stream disconnected", re.IGNORECASE)
STATUS_RE = re.compile(r"(?:unexpected status|last status:?)\s*(\d{3})", re.IGNORECASE)
UNREACHABLE_RE = re.compile(r"connection failed|error sending request|connection refused|waiting for network",
                            re.IGNORECASE)
NO_THREAD_RE = re.compile(r"no rollout found for thread id\s*(\S+)", re.IGNORECASE)
WARNING_ITEM_RE = re.compile(r"model metadata for .* not found", re.IGNORECASE)


class CodexBackend(Backend):
    name = "codex"
    binary = "codex"

    def command(self, *, prompt: str, cwd: str, backend_session_id: str | None,
                env: Mapping[str, str]) -> LaunchSpec:
        argv = [self.executable, "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write",
                "--cd", cwd, *self.extra_args]
        if backend_session_id:
            argv += ["resume", backend_session_id]
            self.usage_before = thread_usage(self.environ.get("CODEX_HOME") or env.get("CODEX_HOME")
                                             or os.path.join(self.environ.get("HOME") or os.path.expanduser("~"),
                                                             ".codex"), backend_session_id)
        return LaunchSpec(argv=argv + ["-"], stdin=prompt, env=dict(env), cwd=cwd)

    def takeover_command(self, backend_session_id: str | None, cwd: str) -> str | None:
        # As printed it must work in any cwd: without --skip-git-repo-check Codex refuses a directory that
        # is not a git repository ("Not inside a trusted directory", observed with 0.169.0).
        if not backend_session_id:
            return None
        return f"codex exec --skip-git-repo-check resume {shlex.quote(backend_session_id)}"

    def parse_event(self, obj: dict) -> list[AgentEvent]:
        kind = obj.get("type")
        if kind == "thread.started" and obj.get("thread_id"):
            return [AgentEvent(EV_SESSION, {"id": str(obj["thread_id"])})]
        if kind == "turn.started":
            return [AgentEvent(EV_PROGRESS, {"message": "turn started"})]
        if kind == "turn.completed":
            events = [AgentEvent(EV_PROGRESS, {"message": "turn completed", "turn_completed": True})]
            usage = obj.get("usage")
            if isinstance(usage, Mapping):
                # On a resumed thread Codex reports the thread's running total: the turn is the difference.
                before = getattr(self, "usage_before", None) or {}
                usage = {k: as_int(usage.get(k)) - as_int(before.get(k)) for k in
                         ("input_tokens", "cached_input_tokens", "output_tokens")}
                total, cached = max(0, usage["input_tokens"]), max(0, usage["cached_input_tokens"])
                events.insert(0, AgentEvent(EV_USAGE, {"input": max(0, total - cached),
                                                       "output": max(0, usage["output_tokens"]),
                                                       "cache_read": cached, "cache_write": 0}))
            return events
        if kind == "turn.failed":
            message = str(first(obj.get("error"), "message") or "turn failed")
            return [error_event(message, fatal=True, cause=failed_cause(message))]
        if kind == "error":
            message = str(obj.get("message") or "error")
            if TRANSIENT_RE.search(message):
                return [retry_progress(message)]
            return [error_event(message)]
        if kind in ("item.started", "item.completed") and isinstance(obj.get("item"), Mapping):
            return self._item(obj["item"], completed=kind == "item.completed")
        return []

    def _item(self, item: Mapping, *, completed: bool) -> list[AgentEvent]:
        kind = item.get("type") or item.get("item_type")
        if not completed:
            if kind == "command_execution":
                return [AgentEvent(EV_PROGRESS, {"message": f"running: {summarise(item.get('command') or '', 120)}"})]
            return []
        if kind == "agent_message" and str(item.get("text", "")).strip():
            return [AgentEvent(EV_TEXT, {"text": item["text"]})]
        if kind == "command_execution":
            return [AgentEvent(EV_TOOL, {"name": "shell", "input": {"command": summarise(item.get("command") or "")},
                                         "status": item.get("status"), "exit_code": item.get("exit_code"),
                                         "id": item.get("id")})]
        if kind == "file_change":
            changes = [{"path": c.get("path"), "kind": c.get("kind")} for c in item.get("changes") or []
                       if isinstance(c, Mapping)]
            return [AgentEvent(EV_TOOL, {"name": "apply_patch", "input": summarise({"changes": changes}),
                                         "status": item.get("status"), "id": item.get("id")})]
        if kind == "mcp_tool_call":
            name = ".".join(str(p) for p in (item.get("server"), item.get("tool")) if p) or "mcp"
            return [AgentEvent(EV_TOOL, {"name": name, "input": summarise(item.get("arguments") or {}),
                                         "status": item.get("status"), "id": item.get("id")})]
        if kind == "web_search":
            return [AgentEvent(EV_TOOL, {"name": "web_search", "input": {"query": summarise(item.get("query") or "")},
                                         "id": item.get("id")})]
        if kind == "todo_list":
            return [AgentEvent(EV_PROGRESS, {"message": "plan updated", "items": summarise(item.get("items") or [])})]
        if kind == "error":
            if WARNING_ITEM_RE.search(str(item.get("message") or "")):
                return [AgentEvent(EV_PROGRESS, {"message": f"warning: {summarise(item.get('message'), 200)}"})]
            return [error_event(item.get("message") or "error", item=True)]
        return []  # reasoning and anything newer

    def failure(self, events, returncode, stderr):
        missing = NO_THREAD_RE.search(stderr or "")
        if missing:
            return "exited_nonzero", (f"Codex has no thread {missing.group(1)} on this machine (its sessions are "
                                      f"under $CODEX_HOME/sessions/ of the daemon's user): hand the work off to a "
                                      f"new session")
        return super().failure(events, returncode, stderr)

    def finish(self, events: list[AgentEvent]) -> list[AgentEvent]:
        if any(e.kind == EV_FINAL for e in events):
            return []
        if not any(e.kind == EV_PROGRESS and e.data.get("turn_completed") for e in events):
            return []
        text = last_text(events)
        return [AgentEvent(EV_FINAL, {"text": text})] if text is not None else []



# A model API's HTTP status in a few words, for the "retrying: …" line.
RETRY_WORDS = {401: "authentication failed", 403: "access refused", 429: "rate limited", 500: "server error",
               502: "gateway error", 503: "service unavailable", 529: "model overloaded"}


def retry_progress(message: str) -> AgentEvent:
    """Codex's ``error`` "Reconnecting... 2/4 (unexpected status 401 Unauthorized: …)" as a progress
    line like Claude's: "retrying: authentication failed (attempt 2 of 4)" (Codex prints no delay;
    "waiting for network" has no count: it never gives up). The ``retry`` data is the turn's live
    "retrying" state in the portal."""
    count, status = RECONNECT_RE.search(message), STATUS_RE.search(message)
    code = int(status.group(1)) if status else None
    if code:
        words = RETRY_WORDS.get(code, f"HTTP {code}")
    elif UNREACHABLE_RE.search(message):
        words = "model API unreachable, waiting for network"
    else:
        words = "stream interrupted"
    attempt, most = (int(count.group(1)), int(count.group(2))) if count else (None, None)
    of = f" (attempt {attempt} of {most})" if count else ""
    return AgentEvent(EV_PROGRESS, {"message": f"retrying: {words}{of}", "detail": summarise(message, 300),
                                    "retry": {"attempt": attempt, "max_retries": most, "error_status": code,
                                              "error": summarise(message, 300)}})


def failed_cause(message: str) -> str:
    """Why a Codex turn failed, in an operator's words (Codex's own message follows)."""
    status = STATUS_RE.search(message)
    if status:
        cause = status_cause(status.group(1))
    elif UNREACHABLE_RE.search(message):
        cause = UNREACHABLE_CAUSE
    elif "high demand" in message.lower():
        cause = "the model API is failing or overloaded"
    else:
        cause = "the model API call failed"
    return f"{cause} — Codex: {message}"[:300]


def thread_usage(codex_home: str, thread_id: str) -> dict | None:
    """The thread's token totals so far, from the last ``token_count`` of its rollout file
    (``$CODEX_HOME/sessions/YYYY/MM/DD/rollout-<time>-<thread id>.jsonl``); None if not found."""
    if not re.fullmatch(r"[0-9A-Za-z-]{8,64}", thread_id or ""):
        return None
    paths = glob.glob(os.path.join(glob.escape(codex_home), "sessions", "*", "*", "*", f"rollout-*-{thread_id}.jsonl"))
    total = None
    for path in paths[:1]:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    if '"token_count"' not in line:
                        continue
                    try:
                        info = (json.loads(line).get("payload") or {}).get("info") or {}
                    except ValueError:
                        continue
                    if isinstance(info.get("total_token_usage"), dict):
                        total = info["total_token_usage"]
        except OSError:
            return None
    return total
