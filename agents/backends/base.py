"""What every backend adapter provides to the daemon (SPEC §5): how to start and resume the agent
CLI, how to read its output, how to stop it, its time limit and its takeover command.

The daemon side of ``agents/`` imports nothing of the portal: this module uses only the standard
library and the shared wire protocol.

Contract of the parsed events (``agents.protocol.EV_*``):

* ``parse_line`` never raises. A line that is not a JSON object becomes ``EV_TEXT`` with
  ``raw: True`` (the backend may say otherwise); a JSON event it does not know is ignored.
* ``EV_SESSION`` may repeat; the last id wins. Backends that keep no session never emit it.
* ``EV_USAGE`` events are additive within one turn: the turn's usage is their sum
  (``usage_total``). Adapters emit the CLI's per-turn total once, not per message.
* ``EV_FINAL`` is the final reply; when a CLI does not print one, ``finish`` derives it after
  the process has exited from the events seen. ``parse_output`` = every line + ``finish``.
* ``EV_ERROR`` data may carry ``kind: "auth"`` when the message reads like missing credentials
  (a hint for the wake error kind of SPEC §3.1), and ``fatal: True`` when the CLI said the turn
  failed (Claude's ``result`` with ``is_error``, Codex's ``turn.failed``) — the daemon then reports
  a crash even if the CLI exits 0 — with ``cause``: the reason in an operator's words.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agents.protocol import (
    EV_ERROR,
    EV_FINAL,
    EV_OUTCOME,
    EV_REQUIRES_ACTION,
    EV_SESSION,
    EV_TEXT,
    EV_TOOL,
    EV_USAGE,
    AgentEvent,
)

ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
AUTH_RE = re.compile(r"log ?in|logged in|api[ _-]?key|unauthori[sz]ed|authenticat|credential|\b401\b|forbidden",
                     re.IGNORECASE)
SUMMARY_LIMIT = 200
USAGE_KEYS = ("input", "output", "cache_read", "cache_write")


@dataclass
class LaunchSpec:
    """How to start one turn: argv (no shell), text for stdin (None: no stdin), extra environment
    laid over the daemon's own, and the working directory."""

    argv: list[str]
    stdin: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None


class Backend:
    """Base adapter. Subclasses set ``name`` and ``binary`` and implement ``command`` and
    ``parse_event``; the rest has sensible defaults.

    Machine-level settings come from ``environ`` (the daemon's environment by default):
    ``CHORUS_<NAME>_BIN`` replaces the executable, ``CHORUS_<NAME>_ARGS`` adds arguments
    (shell-quoted) after the adapter's own options.
    """

    name: ClassVar[str] = ""
    binary: ClassVar[str] = ""
    keeps_session: ClassVar[bool] = True
    stop_signal_first: ClassVar[int] = signal.SIGINT

    def __init__(self, environ: Mapping[str, str] | None = None):
        self.environ: dict[str, str] = dict(os.environ if environ is None else environ)

    # ------------------------------------------------------------------ configuration
    @property
    def env_prefix(self) -> str:
        return "CHORUS_" + self.name.upper()

    @property
    def executable(self) -> str:
        return self.environ.get(f"{self.env_prefix}_BIN") or self.binary

    @property
    def extra_args(self) -> list[str]:
        return shlex.split(self.environ.get(f"{self.env_prefix}_ARGS", ""))

    @property
    def default_timeout_s(self) -> float | None:
        """The backend's own turn time limit in seconds (None: no limit)."""
        return None

    # ------------------------------------------------------------------ launching
    def command(self, *, prompt: str, cwd: str, backend_session_id: str | None,
                env: Mapping[str, str]) -> LaunchSpec:
        raise NotImplementedError

    def takeover_command(self, backend_session_id: str | None, cwd: str) -> str | None:
        """The command an operator runs in ``cwd`` to continue the session by hand (SPEC §4.5);
        None while the id is unknown or when the backend keeps no session."""
        return None

    def protocol_stop(self, process) -> bool:
        """Ask the agent to stop through its own protocol; True if a request was sent.

        The daemon tries this first and falls back to ``stop_signal_first`` (SIGINT) when it
        answers False. None of the CLI modes used here has such a request: their
        non-interactive modes take the prompt once and stop on SIGINT.
        """
        return False

    def failure(self, events: list[AgentEvent], returncode: int, stderr: str) -> tuple[str, str] | None:
        """The wake error (kind, summary) a failed run amounts to, in an operator's words, from the
        events the CLI printed and its stderr tail; None: the daemon's generic classification."""
        fatal = [e for e in events if e.kind == EV_ERROR and e.data.get("fatal")]
        if not fatal:
            return None
        data = fatal[-1].data
        kind = "auth" if data.get("kind") == "auth" else "exited_nonzero"
        return kind, str(data.get("cause") or data.get("message") or "the backend reported an error")

    # ------------------------------------------------------------------ parsing
    def parse_line(self, line: str | bytes) -> list[AgentEvent]:
        try:
            if isinstance(line, bytes):
                line = line.decode("utf-8", "replace")
            text = line.strip()
            if not text:
                return []
            if text.startswith("{"):
                try:
                    obj = json.loads(text)
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    return [e for e in self.parse_event(obj) if e is not None]
            return self.parse_text(text)
        except Exception:  # noqa: BLE001 — a surprising line must never break the daemon
            return [AgentEvent(EV_TEXT, {"text": strip_ansi(str(line)).strip(), "raw": True})]

    def parse_event(self, obj: dict[str, Any]) -> list[AgentEvent]:
        return []

    def parse_text(self, text: str) -> list[AgentEvent]:
        clean = strip_ansi(text).strip()
        return [AgentEvent(EV_TEXT, {"text": clean, "raw": True})] if clean else []

    def finish(self, events: list[AgentEvent]) -> list[AgentEvent]:
        """Events to add once the process has exited, given every event parsed from its output."""
        return []

    def parse_output(self, output: str | bytes | Iterable[str]) -> list[AgentEvent]:
        if isinstance(output, bytes):
            output = output.decode("utf-8", "replace")
        lines = output.splitlines() if isinstance(output, str) else output
        events: list[AgentEvent] = []
        for line in lines:
            events.extend(self.parse_line(line))
        return events + self.finish(events)


# ---------------------------------------------------------------------- helpers for adapters

def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


def summarise(value: Any, limit: int = SUMMARY_LIMIT) -> Any:
    """A tool input made small enough to show and store: long strings cut, depth limited."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"… ({len(value)} chars)"
    if isinstance(value, Mapping):
        return {str(k): summarise(v, limit) for k, v in list(value.items())[:20]}
    if isinstance(value, (list, tuple)):
        items = [summarise(v, limit) for v in value[:10]]
        return items + [f"… ({len(value)} items)"] if len(value) > 10 else items
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return summarise(str(value), limit)


def error_event(message: Any, **extra) -> AgentEvent:
    text = strip_ansi(str(message or "error")).strip()[:2000]
    data = {"message": text, **extra}
    if "kind" not in data and AUTH_RE.search(text):
        data["kind"] = "auth"
    return AgentEvent(EV_ERROR, data)


# What a model API's HTTP status means to an operator (both CLIs print the status they got).
STATUS_CAUSES = {
    401: "the model API rejected the API key (401 unauthorized): check the key the daemon passes",
    403: "the model API refused access (403 forbidden): check the key's permissions",
    429: "the model API is rate-limiting requests (429): wait or raise the limit",
    500: "the model API failed (500 server error)",
    502: "the model API or its gateway failed (502)",
    503: "the model API is unavailable (503)",
    529: "the model is overloaded (529): try again later",
}
UNREACHABLE_CAUSE = "the model API cannot be reached (connection refused or no network): check the base URL"


def status_cause(status: Any, fallback: str = "") -> str:
    try:
        code = int(status)
    except (TypeError, ValueError):
        return fallback
    return STATUS_CAUSES.get(code, f"the model API answered HTTP {code}")


def first(mapping: Any, *keys: str) -> Any:
    """The first present, non-empty value of ``keys`` in ``mapping`` (None for a non-mapping)."""
    if not isinstance(mapping, Mapping):
        return None
    for key in keys:
        value = mapping.get(key)
        if value not in (None, "", [], {}):
            return value
    return None


def as_int(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def normalise_usage(raw: Any) -> dict[str, int] | None:
    """Token counts under the names the portal uses, from the spellings CLIs and APIs use.

    ``input`` counts uncached input only; ``cache_read`` the input served from cache. APIs that
    report cached tokens inside the input total (OpenAI ``cached_input_tokens``) are handled by
    the caller; DeepSeek's ``prompt_cache_hit/miss_tokens`` are mapped here.
    """
    if not isinstance(raw, Mapping):
        return None
    usage = {
        "input": as_int(first(raw, "input_tokens", "inputTokens", "input", "prompt_cache_miss_tokens",
                            "prompt_tokens", "promptTokens")),
        "output": as_int(first(raw, "output_tokens", "outputTokens", "output", "completion_tokens",
                             "completionTokens")),
        "cache_read": as_int(first(raw, "cache_read_input_tokens", "cacheReadInputTokens", "cache_read",
                                 "cacheReadTokens", "prompt_cache_hit_tokens")),
        "cache_write": as_int(first(raw, "cache_creation_input_tokens", "cacheCreationInputTokens",
                                  "cache_write", "cacheWriteTokens")),
    }
    return usage


def usage_total(events: Iterable[AgentEvent]) -> dict[str, int]:
    total = dict.fromkeys(USAGE_KEYS, 0)
    for event in events:
        if event.kind == EV_USAGE:
            for key in USAGE_KEYS:
                total[key] += as_int(event.data.get(key))
    return total


def last_text(events: Iterable[AgentEvent], *, raw: bool = False) -> str | None:
    """The last non-empty assistant text (structured text only unless ``raw``)."""
    text = None
    for event in events:
        if event.kind == EV_TEXT and (raw or not event.data.get("raw")) and str(event.data.get("text", "")).strip():
            text = event.data["text"]
    return text


def summarise_events(events: Iterable[AgentEvent]) -> dict[str, Any]:
    """What a finished turn amounts to, for the daemon's ``advance`` report."""
    events = list(events)
    summary: dict[str, Any] = {"backend_session_id": None, "final_reply": None, "usage": usage_total(events),
                               "requires_action": None, "outcome": None, "errors": [], "tools": 0}
    for event in events:
        if event.kind == EV_SESSION and event.data.get("id"):
            summary["backend_session_id"] = str(event.data["id"])
        elif event.kind == EV_FINAL:
            summary["final_reply"] = event.data.get("text")
        elif event.kind == EV_REQUIRES_ACTION:
            summary["requires_action"] = {"kind": event.data.get("kind"), "items": event.data.get("items", [])}
        elif event.kind == EV_OUTCOME:
            summary["outcome"] = dict(event.data)
        elif event.kind == EV_ERROR:
            summary["errors"].append(dict(event.data))
        elif event.kind == EV_TOOL:
            summary["tools"] += 1
    return summary
