"""A tolerant reader for JSON-lines streams whose schema is young or not published in full
(Kiro's ``--output-format stream-json``, dsh's ``--jsonl``).

It recognises events by the names such streams use for the same things — a session start, an
assistant text or text delta, a tool call, an error, a closing result with usage — and ignores
the rest. Lines that are not JSON are plain transcript text (older releases print only text).
When the stream names no final reply, ``finish`` derives it: the streamed text deltas joined,
else the last assistant message, else the plain text lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agents.protocol import EV_ERROR, EV_FINAL, EV_PROGRESS, EV_SESSION, EV_TEXT, EV_TOOL, EV_USAGE, AgentEvent

from .base import Backend, error_event, first, last_text, normalise_usage, summarise


def _norm(kind: Any) -> str:
    return str(kind or "").replace("_", "").replace("-", "").replace(".", "").lower()


START_TYPES = {"init", "session", "sessionstart", "sessionstarted", "start", "runstart", "system", "threadstarted"}
TEXT_TYPES = {"text", "message", "assistant", "assistantmessage", "agentmessage", "content", "response"}
DELTA_TYPES = {"delta", "textdelta", "assistantdelta", "messagedelta", "chunk", "contentdelta"}
TOOL_TYPES = {"tool", "tooluse", "toolcall", "toolstart", "toolusestart", "toolcallstart", "functioncall"}
ERROR_TYPES = {"error", "runerror", "turnfailed", "failure", "failed", "fatal"}
RESULT_TYPES = {"result", "runend", "runcomplete", "runcompleted", "end", "done", "final", "turncompleted",
                "complete", "completed", "turnend"}
USER_ROLES = {"user", "human", "prompt"}
SESSION_KEYS = ("session_id", "sessionId", "conversation_id", "conversationId", "thread_id", "threadId")


def text_of(value: Any) -> str:
    """Text out of the shapes streams use: a string, content blocks, or {text|content|data}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(text_of(v) for v in value if not (isinstance(v, Mapping) and _is_non_text_block(v)))
    if isinstance(value, Mapping):
        return text_of(first(value, "text", "content", "data", "value", "delta"))
    return ""


def _is_non_text_block(block: Mapping) -> bool:
    kind = _norm(block.get("type") or block.get("kind"))
    return bool(kind) and kind not in ("text", "outputtext", "markdown")


def session_id_of(obj: Mapping) -> str | None:
    value = first(obj, *SESSION_KEYS)
    if value is None and isinstance(obj.get("session"), Mapping):
        value = first(obj["session"], "id", *SESSION_KEYS)
    if value is None and isinstance(obj.get("session"), str):
        value = obj["session"]
    return str(value) if value else None


class LooseJsonBackend(Backend):
    """Parsing for backends whose JSON events are matched by name rather than by a fixed schema."""

    def parse_event(self, obj: dict) -> list[AgentEvent]:
        kind = _norm(first(obj, "type", "event", "kind"))
        data = obj.get("data") if isinstance(obj.get("data"), Mapping) else obj
        if kind in START_TYPES:
            events = [AgentEvent(EV_PROGRESS, {"message": "session started", "model": first(data, "model")})]
            sid = session_id_of(data) or session_id_of(obj)
            return ([AgentEvent(EV_SESSION, {"id": sid})] if sid else []) + events
        if kind in RESULT_TYPES:
            return self._result(obj, data)
        if kind in ERROR_TYPES:
            error = first(data, "error", "message", "reason")
            return [error_event(first(error, "message") if isinstance(error, Mapping) else error)]
        if str(first(data, "role") or "").lower() in USER_ROLES:
            return []
        if kind in DELTA_TYPES:
            text = text_of(first(data, "delta", "text", "content"))
            return [AgentEvent(EV_TEXT, {"text": text, "delta": True})] if text else []
        if kind in TEXT_TYPES:
            text = text_of(first(data, "text", "content", "message"))
            return [AgentEvent(EV_TEXT, {"text": text})] if text.strip() else []
        if kind in TOOL_TYPES:
            name = first(data, "name", "tool", "toolName", "tool_name")
            name = first(name, "name") if isinstance(name, Mapping) else name
            tool_input = first(data, "input", "args", "arguments", "params", "parameters") or {}
            return [AgentEvent(EV_TOOL, {"name": str(name or "tool"), "input": summarise(tool_input),
                                         "id": first(data, "id", "toolUseId", "tool_use_id", "callId")})]
        if kind == "usage":
            usage = normalise_usage(first(data, "usage") or data)
            return [AgentEvent(EV_USAGE, usage)] if usage else []
        return []

    def _result(self, obj: Mapping, data: Mapping) -> list[AgentEvent]:
        events = []
        sid = session_id_of(data) or session_id_of(obj)
        if sid:
            events.append(AgentEvent(EV_SESSION, {"id": sid}))
        usage = normalise_usage(first(data, "usage", "tokenUsage", "token_usage", "tokens", "stats"))
        if usage:
            events.append(AgentEvent(EV_USAGE, usage))
        status = _norm(first(data, "status", "subtype", "outcome"))
        error = first(data, "error")
        failed = bool(data.get("is_error") or data.get("isError") or error) or status in (
            "error", "failed", "failure", "cancelled", "canceled", "aborted", "interrupted", "incomplete")
        text = first(data, "result", "text", "output", "response", "final", "message", "content")
        text = text if isinstance(text, str) else (text_of(text) or None)
        if failed:
            message = first(error, "message") if isinstance(error, Mapping) else error
            events.append(error_event(message or text or status or "failed", status=status or None))
        elif text is not None:
            events.append(AgentEvent(EV_FINAL, {"text": text}))
        return events

    def finish(self, events: list[AgentEvent]) -> list[AgentEvent]:
        if any(e.kind in (EV_FINAL, EV_ERROR) for e in events):
            return []
        deltas = [e.data["text"] for e in events if e.kind == EV_TEXT and e.data.get("delta")]
        text = "".join(deltas) if deltas else last_text(events)
        if text is None:
            lines = [e.data.get("text", "") for e in events if e.kind == EV_TEXT and e.data.get("raw")]
            text = "\n".join(lines).strip() or None
        return [AgentEvent(EV_FINAL, {"text": text})] if text is not None and text.strip() else []
