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
  ``requires_action`` (confirmation): the operator's answer arrives as a resumed turn, typically
  together with a wider ``--permission-mode``/``--allowedTools`` in CHORUS_CLAUDE_CODE_ARGS.

No protocol stop in this mode: SIGINT ends the run (the session so far is kept on disk).
"""

from __future__ import annotations

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

from .base import Backend, LaunchSpec, error_event, normalise_usage, summarise


class ClaudeCodeBackend(Backend):
    name = "claude_code"
    binary = "claude"

    def command(self, *, prompt: str, cwd: str, backend_session_id: str | None,
                env: Mapping[str, str]) -> LaunchSpec:
        argv = [self.executable, "-p", "--output-format", "stream-json", "--verbose"]
        if backend_session_id:
            argv += ["--resume", backend_session_id]
        return LaunchSpec(argv=argv + self.extra_args, stdin=prompt, env=dict(env), cwd=cwd)

    def takeover_command(self, backend_session_id: str | None, cwd: str) -> str | None:
        return f"claude --resume {shlex.quote(backend_session_id)}" if backend_session_id else None

    def parse_event(self, obj: dict) -> list[AgentEvent]:
        kind = obj.get("type")
        if kind == "system":
            if obj.get("subtype") == "init" and obj.get("session_id"):
                return [AgentEvent(EV_SESSION, {"id": str(obj["session_id"])}),
                        AgentEvent(EV_PROGRESS, {"message": "session started", "model": obj.get("model")})]
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
            hint = {"kind": "auth"} if "auth" in str(obj["error"]) else {}
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
            items = [{"id": str(d.get("tool_use_id") or f"denial-{i}"),
                      "text": f"allow {d.get('tool_name') or 'tool'}: "
                              f"{summarise(d.get('tool_input') or {}, 120)}"} for i, d in enumerate(denials, 1)]
            events.append(AgentEvent(EV_REQUIRES_ACTION, {"kind": "confirmation", "items": items}))
        text = obj.get("result")
        if obj.get("is_error") or obj.get("subtype", "success") != "success":
            events.append(error_event(text or obj.get("subtype") or "error", subtype=obj.get("subtype")))
        elif isinstance(text, str):
            events.append(AgentEvent(EV_FINAL, {"text": text}))
        return events
