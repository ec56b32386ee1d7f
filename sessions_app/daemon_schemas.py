"""The shapes a daemon may send (SPEC §5, agents/protocol.py): WebSocket frames and HTTP reports.

Everything a daemon sends is validated here before anything of it is stored: a value the portal's
own readers cannot read back (an ``exit_code`` of "3x", a pid beyond PostgreSQL's integer, a wake
error without a kind) is refused at the door — as an ``error`` frame on the socket, a §8 422 body
over HTTP — instead of settling a turn that every later read then fails on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from uuid import UUID

from ninja import Schema
from pydantic import ConfigDict, Field, ValidationError

from agents import protocol as wire
from chorus_site.errors import ApplicationError

from . import states

PG_INT_MAX = 2**31 - 1
PG_BIGINT_MAX = 2**63 - 1
TEXT_MAX = 1024 * 1024          # a final reply, captured output (wake_error_build keeps the last 64 KiB)
EVENTS_PER_REPORT_MAX = 1000

Pid = Annotated[int, Field(ge=1, le=PG_INT_MAX)]
Count = Annotated[int, Field(ge=0, le=PG_BIGINT_MAX)]
Seconds = Annotated[float, Field(ge=0, le=10**10)]
ShortText = Annotated[str, Field(max_length=255)]
ReportId = Annotated[str, Field(min_length=1, max_length=255)]


class _Strict(Schema):
    model_config = ConfigDict(extra="forbid")


class _Lenient(Schema):
    """Fields a newer daemon adds are ignored (not stored), the known ones are checked."""

    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- report parts
class WakeErrorIn(_Strict):
    kind: Literal[tuple(states.WAKE_ERROR_KINDS)]
    summary: Annotated[str, Field(max_length=4000)] | None = None
    source: Annotated[str, Field(max_length=255)] = ""
    details: Annotated[str, Field(max_length=TEXT_MAX)] | None = None
    exit_code: Annotated[int, Field(ge=-PG_INT_MAX - 1, le=PG_INT_MAX)] | None = None
    signal: Annotated[str, Field(max_length=32)] | None = None


class UsageIn(_Lenient):
    input: Count = 0
    output: Count = 0
    cache_read: Count = 0
    cache_write: Count = 0


class BackgroundProcessIn(_Lenient):
    pid: Pid
    cmdline: Annotated[str, Field(max_length=4096)] = ""


class RequiresActionItemIn(_Lenient):
    id: Annotated[str, Field(max_length=255)] | int
    text: Annotated[str, Field(max_length=TEXT_MAX)] = ""
    # The tool a "yes" allows for the resumed run (a Claude Code permission denial).
    allow: Annotated[str, Field(max_length=255)] | None = None


class RequiresActionIn(_Lenient):
    kind: Literal["confirmation", "external_execution"] = "confirmation"
    items: Annotated[list[RequiresActionItemIn], Field(max_length=100)] = []


class OutcomeIn(_Lenient):
    intent: Annotated[str, Field(max_length=64)]
    ref: Annotated[str, Field(max_length=1024)] | None = None
    summary: Annotated[str, Field(max_length=TEXT_MAX)] | None = None


class AdvanceReportIn(_Lenient):
    """``protocol.AdvanceReport`` as the portal accepts it."""

    report_id: ReportId
    status: Literal[wire.RUNNING, wire.REQUIRES_ACTION, wire.ENDED, wire.INTERRUPTED] | None = None
    reason: Literal[wire.DAEMON_REASONS] | None = None
    stop_state: Literal[wire.STOP_SIGNALLED, wire.STOP_ESCALATED, wire.STOP_CONFIRMED] | None = None
    pid: Pid | None = None
    backend_session_id: ShortText | None = None
    final_reply: Annotated[str, Field(max_length=TEXT_MAX)] | None = None
    usage: UsageIn | None = None
    changes: dict[str, Any] | None = None
    background_processes: Annotated[list[BackgroundProcessIn], Field(max_length=1000)] | None = None
    wake_error: WakeErrorIn | None = None
    requires_action: RequiresActionIn | None = None
    outcome: OutcomeIn | None = None


class AgentEventIn(_Lenient):
    kind: Annotated[str, Field(max_length=64)]   # unknown kinds of newer daemons are skipped, not refused
    data: dict[str, Any] = {}


class EventsReportIn(_Lenient):
    report_id: ReportId
    events: Annotated[list[AgentEventIn], Field(max_length=EVENTS_PER_REPORT_MAX)]


class RunningTurnIn(Schema):
    """``protocol.RunningTurn``; fields added by newer daemons are kept (the snapshot is evidence)."""

    model_config = ConfigDict(extra="allow")
    turn: UUID
    session: Annotated[str, Field(max_length=64)]
    pid: Pid
    pgid: Pid
    started_at: Seconds
    process_start_time: Seconds


class SpoolHealthIn(_Lenient):
    """What the daemon's report spool holds (agents/spool.py ``ReportSender.health``)."""

    queued: Count = 0
    parked: Count = 0
    refused_total: Count = 0
    oldest_queued_age_s: Seconds | None = None
    oldest_parked_age_s: Seconds | None = None
    last_refusal: dict[str, Annotated[str, Field(max_length=500)] | int | float | None] | None = None


class SnapshotReportIn(_Lenient):
    report_id: ReportId | None = None
    running: Annotated[list[RunningTurnIn], Field(max_length=10000)]


# ---------------------------------------------------------------- WebSocket frames
class HelloFrame(_Lenient):
    type: Literal[wire.HELLO]
    version: Annotated[str, Field(max_length=32)] = ""
    protocol: Annotated[int, Field(ge=0, le=1000)] | None = None
    host: ShortText = ""
    backends: Annotated[list[Annotated[str, Field(max_length=32)]], Field(max_length=32)] = []
    cwds: Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=256)] = []
    max_concurrency: Annotated[int, Field(ge=1, le=10000)] | None = None
    sigint_timeout_s: Annotated[float, Field(ge=0, le=3600)] | None = None
    spool: SpoolHealthIn | None = None


class TurnActivityIn(_Lenient):
    """The daemon's process sample of one running turn (agents/proctree.py ActivitySampler)."""

    turn: UUID
    state: Literal["busy", "waiting_on_child", "silent"]
    cpu_percent: Annotated[float, Field(ge=0, le=10**6)] | None = None
    silent_s: Seconds | None = None
    stdout_lines: Count | None = None
    agent_alive: bool | None = None
    children: Annotated[list[BackgroundProcessIn], Field(max_length=100)] = []


class HeartbeatFrame(_Lenient):
    type: Literal[wire.HEARTBEAT]
    spool: SpoolHealthIn | None = None
    running: Annotated[list[UUID], Field(max_length=10000)] | None = None   # the turns it runs (reconcile)
    activity: Annotated[list[TurnActivityIn], Field(max_length=10000)] | None = None  # stall evidence


class SnapshotFrame(_Lenient):
    type: Literal[wire.SNAPSHOT]
    running: Annotated[list[RunningTurnIn], Field(max_length=10000)] = []
    spool: SpoolHealthIn | None = None
    queued: Annotated[list[UUID], Field(max_length=10000)] | None = None    # taken, waiting for capacity


class AckFrame(_Lenient):
    type: Literal[wire.ACK]
    command: UUID


class ResultFrame(_Lenient):
    type: Literal[wire.RESULT]
    command: UUID
    result: dict[str, Any] = {}


FRAMES: dict[str, type[Schema]] = {
    wire.HELLO: HelloFrame, wire.HEARTBEAT: HeartbeatFrame, wire.SNAPSHOT: SnapshotFrame,
    wire.ACK: AckFrame, wire.RESULT: ResultFrame,
}


def _errors(exc: ValidationError) -> list[dict]:
    """The first few problems, JSON-safe and without echoing the (possibly huge) input."""
    return [{"loc": [str(part) for part in e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_input=False)[:20]]


def validated(schema: type[Schema], data) -> Schema:
    """``data`` as ``schema``, or ApplicationError("validation_error") with the problems (§8, 422)."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ApplicationError("validation_error", f"{schema.__name__} did not validate",
                               {"errors": _errors(exc)}) from None


def as_report(model: Schema) -> dict:
    """A validated report as the plain dict the bridge stores (JSON types, absent fields left out)."""
    return model.model_dump(mode="json", exclude_none=True, exclude_unset=True)
