"""API shapes of sessions_app (SPEC §8)."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from chorus_site.api_output import ResponseSchema as Schema  # validated by pydantic-core alone (issue 9)


class ConnectionOut(Schema):
    id: UUID
    name: str
    host: str
    backend: str
    cwds: list[str]
    status: str
    max_concurrency: int
    sigint_timeout_s: int
    last_heartbeat_at: datetime | None
    daemon_version: str
    capabilities: dict
    created_at: datetime


class TakeoverOut(Schema):
    backend_session_id: str
    cwd: str
    command: str


class SessionOut(Schema):
    id: UUID
    idea_key: str
    title: str
    connection_id: UUID
    connection_name: str
    cwd: str
    backend: str
    backend_session_id: str | None
    provider: str
    model: str
    status: str
    last_turn_at: datetime | None
    tokens: dict
    created_at: datetime
    created_by: str | None
    handoff_from: UUID | None
    handoff_to: UUID | None
    takeover: TakeoverOut | None = None


class WakeErrorOut(Schema):
    summary: str
    kind: str
    source: str
    exit_code: int | None
    signal: str | None
    details: str | None = None
    details_withheld: bool


class RetryingOut(Schema):
    """The CLI retries a failed model call itself: its own words and counts (selectors.turn_retrying)."""

    message: str                        # e.g. "retrying: authentication failed (attempt 4 of 10, next in 9 s)"
    attempt: int | None
    max_retries: int | None
    error: str | None
    error_status: int | None
    since: datetime
    next_attempt_at: datetime | None


class TurnOut(Schema):
    id: UUID
    session_id: UUID
    connection_id: UUID | None
    seq: int
    trigger: str
    prompt: str
    status: str
    interrupted_reason: str
    stop_state: str
    wake_error: WakeErrorOut | None
    interrupt_evidence: dict | None
    usage: dict
    attempt_id: UUID | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    final_reply: str
    changes: dict
    background_processes: list
    requires_action: dict | None
    retrying: RetryingOut | None = None   # only while running
    stalled: bool = False              # running and silent past its threshold (docs/alerts.md)
    stalled_at: datetime | None = None
    stall_evidence: dict | None = None


class DiagnosticsOut(Schema):
    turn_id: UUID
    status: str
    interrupted_reason: str
    wake_error: dict | None
    redacted_for_sharing: bool


class TranscriptMessageOut(Schema):
    id: int
    turn_id: UUID | None
    role: str
    text: str
    at: datetime


class PreflightOut(Schema):
    session_id: UUID
    resumable: bool
    refusal: str | None
    connection_status: str
    connection_online: bool
    cwd: str
    cwd_allowed: bool
    backend_session_id_present: bool
    last_turn_status: str | None
    last_turn_reason: str | None
    last_turn_age_s: float | None
    files_changed_since: dict
    git_head_then: str | None = None


class Page(Schema):
    next_cursor: str | None


class ConnectionPage(Page):
    items: list[ConnectionOut]


class SessionPage(Page):
    items: list[SessionOut]


class TurnPage(Page):
    items: list[TurnOut]


class TranscriptPage(Page):
    items: list[TranscriptMessageOut]
