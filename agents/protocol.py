"""The wire protocol between a daemon and the portal (SPEC §5). Shared by both sides.

This module imports nothing of the portal (the daemon runs on other machines) and nothing but
the standard library.

Transport
---------
* WebSocket ``/ws/daemon/`` — control and presence. The daemon authenticates with the header
  ``Authorization: Bearer <connection key>``.
* HTTP ``/api/v1/daemon/...`` — reports, with the same header. Every report carries a
  ``report_id`` (uuid4) chosen by the daemon: the portal applies a report id once and answers
  the same to a repeat, so the daemon may retry and spool freely.

WebSocket messages (JSON objects with a ``type``)
-------------------------------------------------
daemon → portal
  hello      {version, host, backends: [..], cwds: [..], max_concurrency, sigint_timeout_s, spool}
  heartbeat  {spool, running: [turn id], activity: [TurnActivity]}
                                                 running: the turns it runs (the portal reopens one
                                                 it settled offline meanwhile); activity: per running
                                                 agent {turn, state: busy|waiting_on_child|silent,
                                                 cpu_percent, silent_s, stdout_lines, agent_alive,
                                                 children: [{pid, cmdline}]}, redacted (stall evidence)
  snapshot   {running: [RunningTurn], queued: [turn id], spool}
                                                 on connect and whenever the running set changes;
                                                 queued: starts taken but waiting for capacity here
             spool: the report spool's health {queued, parked, refused_total, unspooled,
             oldest_queued_age_s, oldest_parked_age_s, last_refusal} (agents/spool.py)
  ack        {command}                           the command was received (delivered → acked)
  result     {command, result: {...}}            e.g. probe → {"held": bool}; done
portal → daemon
  welcome    {connection, heartbeat_interval_s, heartbeat_timeout_s}
  command    {id, action, turn, payload}         replayed on reconnect until acked or expired
  error      {code, message, detail?, in_reply_to?}   e.g. a frame that did not validate

Command payloads
----------------
start_turn / resume: {session, cwd, prompt, backend, backend_session_id|null, trigger,
                      env: {CHORUS_API_URL, CHORUS_TASK_TOKEN?}, timeout_s|null}
interrupt:           {sigint_timeout_s}
probe:               {}

Reports (HTTP POST bodies)
--------------------------
advance  /api/v1/daemon/turns/{turn}/advance  see ``AdvanceReport``
events   /api/v1/daemon/turns/{turn}/events   {report_id, events: [AgentEvent as dict]}
snapshot /api/v1/daemon/snapshot              {report_id, running: [RunningTurn]}
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
DAEMON_WS_PATH = "/ws/daemon/"
API_PREFIX = "/api/v1"
HEARTBEAT_INTERVAL_S = 5
HEARTBEAT_TIMEOUT_S = 20
# The portal never sends a command frame larger than this (UTF-8 bytes); the daemon accepts frames
# of up to 4 MiB (agents/daemon.py WS_MAX_MESSAGE), so a command that fits is always taken.  A
# larger command is expired with a reason instead, so it cannot crash-loop the connection.
COMMAND_MAX_BYTES = 1024 * 1024

# Messages
HELLO, HEARTBEAT, SNAPSHOT, ACK, RESULT = "hello", "heartbeat", "snapshot", "ack", "result"
WELCOME, COMMAND, ERROR = "welcome", "command", "error"
# Close code the portal gives a daemon socket that a newer socket with the same key replaced.
SOCKET_REPLACED_CLOSE = 4409

# Command actions
START_TURN, INTERRUPT, RESUME, PROBE = "start_turn", "interrupt", "resume", "probe"

# Turn statuses a daemon may report (``offline`` is the server's verdict alone)
RUNNING, REQUIRES_ACTION, ENDED, INTERRUPTED = "running", "requires_action", "ended", "interrupted"
DAEMON_REASONS = ("user", "crash", "shutdown", "invalid_path", "timeout")

# Stop progress (§4.1)
STOP_SIGNALLED, STOP_ESCALATED, STOP_CONFIRMED = "signalled", "escalated", "confirmed"

# Wake error kinds (§3.1)
WAKE_ERROR_KINDS = ("spawn_failed", "exited_nonzero", "signal", "invalid_path", "auth", "timeout", "protocol")

# Normalised agent events parsed from each backend's output
EV_SESSION = "session"            # data: {id}            the backend's own session id
EV_TEXT = "text"                  # data: {text}          assistant text (a message or a chunk)
EV_TOOL = "tool"                  # data: {name, input}   a tool call (input summarised)
EV_PROGRESS = "progress"          # data: {message}
EV_USAGE = "usage"                # data: {input, output, cache_read, cache_write}
EV_FINAL = "final"                # data: {text}          the final reply
EV_REQUIRES_ACTION = "requires_action"  # data: {kind: confirmation|external_execution, items: [{id, text}]}
EV_OUTCOME = "outcome"            # data: {intent, ref?, summary?}
EV_ERROR = "error"                # data: {message}
EVENT_KINDS = (EV_SESSION, EV_TEXT, EV_TOOL, EV_PROGRESS, EV_USAGE, EV_FINAL, EV_REQUIRES_ACTION, EV_OUTCOME,
               EV_ERROR)


def new_report_id() -> str:
    return str(uuid.uuid4())


def encode(message: dict) -> str:
    # Non-ASCII text goes as itself (UTF-8 on the wire): escaped, each "é" would cost 6 bytes and a
    # prompt within the portal's bound could become a frame beyond the peer's limit.
    return json.dumps(message, separators=(",", ":"), default=str, ensure_ascii=False)


def encoded_size(message: dict) -> int:
    """The size in bytes of ``message`` on the wire."""
    return len(encode(message).encode("utf-8"))


def decode(raw: str | bytes) -> dict:
    """A JSON object with a string ``type``, or ValueError."""
    try:
        message = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    except RecursionError:  # nested deeper than the parser goes: refused like any malformed frame
        raise ValueError("not JSON: nested too deeply") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError("a message is a JSON object with a string 'type'")
    return message


@dataclass
class AgentEvent:
    kind: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunningTurn:
    turn: str
    session: str
    pid: int
    pgid: int
    started_at: float          # epoch seconds when the daemon spawned it
    process_start_time: float  # the OS's start time of ``pid`` (checked before any signal)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class AdvanceReport:
    """One lifecycle step of a turn, as the daemon reports it."""

    report_id: str
    status: str                               # running | requires_action | ended | interrupted
    reason: str | None = None                 # for interrupted: user|crash|shutdown|invalid_path|timeout
    stop_state: str | None = None             # signalled | escalated | confirmed (interrupt progress)
    pid: int | None = None
    backend_session_id: str | None = None
    final_reply: str | None = None
    usage: dict | None = None                 # {input, output, cache_read, cache_write}
    changes: dict | None = None               # {git: bool, status: [..], diff_stat: str, files: [..]}
    background_processes: list | None = None  # [{pid, cmdline}] left alive after the agent exited
    wake_error: dict | None = None            # {kind, summary, source, details, exit_code, signal}
    requires_action: dict | None = None       # {kind, items: [{id, text}]}
    outcome: dict | None = None               # {intent, ref?, summary?} reported by the agent

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}
