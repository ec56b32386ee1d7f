"""Backend ``claude_code``: Claude Code in print mode with the streaming JSON output.

    claude -p --output-format stream-json --verbose [--resume <session id>] [CHORUS_CLAUDE_CODE_ARGS]

The prompt goes to stdin (print mode reads it when no prompt argument is given). Each stdout line
is one JSON message:

* ``system`` / ``init``: ``session_id``, ``cwd``, ``model``, ``tools`` — the session id to resume;
* ``assistant``: ``message.content`` blocks — ``text`` and ``tool_use`` {id, name, input};
  messages with a ``parent_tool_use_id`` come from a subagent (their text is not the reply);
  an ``error`` field (e.g. ``authentication_failed``) marks a failed request;
* ``user``: tool results echoed back (not transcript; ignored);
* ``result``: ``subtype`` (``success`` | ``error_max_turns`` | ``error_during_execution``),
  ``is_error``, ``result`` (the final reply), ``session_id``, ``usage`` (the whole run:
  ``input_tokens``, ``output_tokens``, ``cache_read_input_tokens``,
  ``cache_creation_input_tokens``) and ``permission_denials`` [{tool_name, tool_use_id,
  tool_input}] — tools the non-interactive run was not allowed to use. Those become a
  ``requires_action`` (confirmation) whose items name the tool (``allow``): a "yes" resumes the
  session with ``--allowedTools <tool>`` added for that run (sessions_app.actions), the answer as
  the prompt.

Observed with 2.1.328 against tests/model_standin.py (docs/daemon-backends.md has the table):

* ``system`` / ``api_retry`` {attempt, max_retries, retry_delay_ms, error_status, error}: the CLI
  retries a failed API call itself (10 times by default, ``CLAUDE_CODE_MAX_RETRIES``), also a 401;
  shown as progress "retrying: authentication failed (attempt 4 of 10, next in 9 s)" (the turn's
  live "retrying" state in the portal until other output follows); the delay doubles from ~0.5 s
  (a ``retry-after`` header lengthens it, never shortens it); SIGINT during the wait stops the run;
* after the retries an ``assistant`` message with ``error``, ``api_error_status`` and the CLI's
  text, then ``result`` with ``subtype: success`` but ``is_error: true``, ``terminal_reason:
  api_error``; exit code 1. A connection refused has ``api_error_status: null``;
* ``system`` / ``permission_denied`` {tool_name, message} when the permission mode refuses a tool
  (the model is told and goes on; the ``result`` lists it in ``permission_denials``);
* ``--resume <unknown id>``: only a ``result`` (``error_during_execution``, ``errors: ["No
  conversation found with session ID: …"]``), exit 1;
* SIGINT mid-stream: the partial text as an ``assistant`` message, ``[Request interrupted by
  user]``, a ``result`` with ``is_error`` and ``terminal_reason: aborted_streaming``; exit 0 within
  ~0.2 s; no helper process left. The session (with the partial reply) is kept for ``--resume``.

The daemon's environment reaches the CLI: ``ANTHROPIC_BASE_URL`` (a company gateway, or the
stand-in), ``ANTHROPIC_API_KEY``, ``HOME`` / ``CLAUDE_CONFIG_DIR`` (where sessions live:
``~/.claude/projects/<cwd>/<session id>.jsonl``). The adapter sets ``DISABLE_AUTOUPDATER=1``
unless the environment says otherwise: a daemon's CLI must not replace itself between turns.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from agents.protocol import (
    EV_FINAL,
    EV_PROGRESS,
    EV_REQUIRES_ACTION,
    EV_SESSION,
    EV_TEXT,
    EV_TOOL,
    EV_USAGE,
    AgentEvent,
)

from .base import UNREACHABLE_CAUSE, Backend, LaunchSpec, error_event, normalise_usage, status_cause, summarise

UNKNOWN_SESSION_RE = re.compile(r"No conversation found with session ID:?\s*(\S+)", re.IGNORECASE)


class ClaudeCodeBackend(Backend):
    name = "claude_code"
    binary = "claude"

    def command(self, *, prompt: str, cwd: str, backend_session_id: str | None,
                env: Mapping[str, str], allow_tools: list[str] | None = None) -> LaunchSpec:
        """``allow_tools``: tools the operator allowed by answering a permission denial, added for
        this run as ``--allowedTools`` after the machine's own arguments (repeated flags add up)."""
        argv = [self.executable, "-p", "--output-format", "stream-json", "--verbose"]
        if backend_session_id:
            argv += ["--resume", backend_session_id]
        extra = {} if "DISABLE_AUTOUPDATER" in self.environ or "DISABLE_AUTOUPDATER" in env \
            else {"DISABLE_AUTOUPDATER": "1"}
        widen = ["--allowedTools", ",".join(allow_tools)] if allow_tools else []
        return LaunchSpec(argv=argv + self.extra_args + widen, stdin=prompt, env={**extra, **dict(env)}, cwd=cwd)

    def takeover_command(self, backend_session_id: str | None, cwd: str) -> str | None:
        return f"claude --resume {shlex.quote(backend_session_id)}" if backend_session_id else None

    def parse_event(self, obj: dict) -> list[AgentEvent]:
        kind = obj.get("type")
        if kind == "system":
            if obj.get("subtype") == "init" and obj.get("session_id"):
                return [AgentEvent(EV_SESSION, {"id": str(obj["session_id"])}),
                        AgentEvent(EV_PROGRESS, {"message": "session started", "model": obj.get("model")})]
            if obj.get("subtype") == "api_retry":
                return [retry_progress(obj)]
            if obj.get("subtype") == "permission_denied":
                return [AgentEvent(EV_PROGRESS, {"message": f"permission denied: {obj.get('tool_name') or 'tool'}",
                                                 "detail": summarise(obj.get("message") or "", 300)})]
            return [AgentEvent(EV_PROGRESS, {"message": f"system: {obj.get('subtype') or 'event'}"})]
        if kind == "assistant":
            return self._assistant(obj)
        if kind == "result":
            return self._result(obj)
        return []  # user (tool results), stream_event, rate_limit_event, …

    def _assistant(self, obj: dict) -> list[AgentEvent]:
        events = []
        message = obj.get("message") if isinstance(obj.get("message"), dict) else {}
        subagent = bool(obj.get("parent_tool_use_id"))
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text" and not subagent and str(block.get("text", "")).strip():
                events.append(AgentEvent(EV_TEXT, {"text": block["text"]}))
            elif block.get("type") in ("tool_use", "server_tool_use"):
                data = {"name": str(block.get("name") or "tool"), "input": summarise(block.get("input") or {}),
                        "id": block.get("id")}
                if subagent:
                    data["subagent"] = True
                events.append(AgentEvent(EV_TOOL, data))
        if obj.get("error"):
            said = " ".join(e.data["text"] for e in events if e.kind == EV_TEXT)
            hint = {"kind": "auth"} if "auth" in str(obj["error"]) or obj.get("api_error_status") in (401, 403) else {}
            if obj.get("is_api_error_message"):  # the CLI's own words about a failed API call, not a reply
                events = [e for e in events if e.kind != EV_TEXT]
                events.append(AgentEvent(EV_PROGRESS, {"message": f"API error: {said}"[:300]}))
            events.append(error_event(f"{obj['error']}: {said}".rstrip(": "), **hint))
        return events

    def _result(self, obj: dict) -> list[AgentEvent]:
        events = []
        if obj.get("session_id"):
            events.append(AgentEvent(EV_SESSION, {"id": str(obj["session_id"])}))
        usage = normalise_usage(obj.get("usage"))
        if usage:
            events.append(AgentEvent(EV_USAGE, usage))
        denials = [d for d in obj.get("permission_denials") or [] if isinstance(d, dict)]
        if denials:
            # ``allow``: what a "yes" widens for the resumed run (--allowedTools <tool>). The whole tool:
            # a rule for the exact command, Bash(echo hi > f), does not cover the file it writes (2.1.328).
            items = [{"id": str(d.get("tool_use_id") or f"denial-{i}"),
                      "text": f"allow {d.get('tool_name') or 'tool'}: "
                              f"{summarise(d.get('tool_input') or {}, 120)}",
                      "allow": str(d.get("tool_name") or "")} for i, d in enumerate(denials, 1)]
            items = [{k: v for k, v in item.items() if v} for item in items]
            events.append(AgentEvent(EV_REQUIRES_ACTION, {"kind": "confirmation", "items": items}))
        text = obj.get("result")
        if obj.get("is_error") or obj.get("subtype", "success") != "success":
            errors = [str(e) for e in obj.get("errors") or [] if e]
            message = text or "; ".join(errors) or obj.get("subtype") or "error"
            events.append(error_event(message, subtype=obj.get("subtype"), fatal=True,
                                      cause=result_cause(obj, message, errors),
                                      terminal_reason=obj.get("terminal_reason"),
                                      **({"kind": "auth"} if obj.get("api_error_status") in (401, 403) else {})))
        elif isinstance(text, str):
            events.append(AgentEvent(EV_FINAL, {"text": text}))
        return events


def result_cause(obj: dict, message: str, errors: list[str]) -> str:
    """Why a Claude Code run failed, in an operator's words (the CLI's own text follows)."""
    unknown = next((m for m in map(UNKNOWN_SESSION_RE.search, errors + [message]) if m), None)
    if unknown:
        return (f"Claude Code has no conversation {unknown.group(1)} on this machine (its session files are "
                f"under ~/.claude/projects/ of the daemon's user): hand the work off to a new session")
    if obj.get("terminal_reason") == "api_error":
        status = obj.get("api_error_status")
        cause = status_cause(status, UNREACHABLE_CAUSE if "connect" in message.lower() or "ECONN" in message
                             else "the model API call failed")
        return f"{cause} — Claude Code: {message}"[:300]
    if obj.get("terminal_reason") == "aborted_streaming":
        return "Claude Code was interrupted mid-reply"
    return f"Claude Code reported an error ({obj.get('subtype') or 'error'}): {message}"[:300]


def retry_progress(obj: dict) -> AgentEvent:
    """``system/api_retry`` as a progress line an operator reads: what failed and when the next try
    is, e.g. "retrying: authentication failed (attempt 4 of 10, next in 9 s)". Its ``retry`` data
    is what the portal shows as the turn's live "retrying" state (sessions_app/selectors.py)."""
    error, status = obj.get("error"), obj.get("error_status")
    words = str(error or "error").replace("_", " ")
    if words == "unknown" and not status:
        words = "no answer from the model API"
    attempt, most = obj.get("attempt"), obj.get("max_retries")
    try:
        delay = f", next in {max(0.0, float(obj.get('retry_delay_ms') or 0) / 1000):.0f} s"
    except (TypeError, ValueError):
        delay = ""
    of = f"attempt {attempt} of {most}" if attempt and most else f"attempt {attempt or '?'}"
    return AgentEvent(EV_PROGRESS, {"message": f"retrying: {words} ({of}{delay})", "retry": {
        "attempt": attempt, "max_retries": most, "retry_delay_ms": obj.get("retry_delay_ms"),
        "error_status": status, "error": error}})
