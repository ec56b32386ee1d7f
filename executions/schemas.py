"""API shapes of executions (SPEC §8)."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from chorus_site.api_output import ResponseSchema as Schema  # validated by pydantic-core alone (issue 9)


class IssueOut(Schema):
    id: UUID
    title: str
    body: str
    acceptance_criteria: str
    completion_policy: str
    status: str
    assignee: str | None
    version: int
    created_at: datetime
    updated_at: datetime


class CommentOut(Schema):
    id: UUID
    issue_id: UUID
    type: str
    author: str
    body: str
    source_task_id: UUID | None
    source_attempt_id: UUID | None
    created_at: datetime


class ArtifactOut(Schema):
    id: UUID
    issue_id: UUID
    run_id: UUID | None
    attempt_id: UUID | None
    kind: str
    name: str
    sha256: str
    size: int
    created_at: datetime


class AttemptOut(Schema):
    id: UUID
    task_id: UUID
    number: int
    state: str
    connection_id: UUID | None
    session_id: UUID | None
    turn_id: UUID | None
    backend: str
    provider_session_id: str
    cwd: str
    heartbeat_at: datetime | None
    outcome: dict | None
    failure_code: str
    failure_message: str
    usage: dict
    started_at: datetime | None
    ended_at: datetime | None


class TaskOut(Schema):
    id: UUID
    node_id: UUID
    ordinal: int
    status: str
    retry_of: UUID | None
    retried_by: list[UUID] = []
    leader: bool
    session_id: UUID | None
    current_attempt_id: UUID | None
    result: dict
    error: str
    wait_reason: str
    attempts: list[AttemptOut] = []


class NodeOut(Schema):
    id: UUID
    key: str
    type: str
    state: str
    iteration: int
    depends_on: list
    wait_reason: str
    wait_detail: dict
    failure_code: str
    failure_message: str
    tasks: list[TaskOut]


class RunOut(Schema):
    id: UUID
    issue_id: UUID
    issue_title: str
    mode: str
    state: str
    workflow_revision_id: UUID | None
    parent_run_id: UUID | None
    parent_node_id: UUID | None
    rerun_of: UUID | None
    trigger: str
    input: dict
    output: dict
    target: dict
    policy: dict
    wait_reason: str
    wait_detail: dict
    failure_code: str
    failure_message: str
    version: int
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None


class RunDetailOut(RunOut):
    nodes: list[NodeOut]
    reruns: list[UUID] = []


class RevisionOut(Schema):
    id: UUID
    number: int
    spec: dict
    created_at: datetime


class WorkflowOut(Schema):
    id: UUID
    name: str
    description: str
    created_at: datetime
    revisions: list[RevisionOut]


class ApprovalOut(Schema):
    id: UUID
    node_id: UUID | None
    run_id: UUID | None
    turn_id: UUID | None
    prompt: str
    status: str
    version: int
    created_at: datetime


class InboxOut(Schema):
    review: list[IssueOut]
    approvals: list[ApprovalOut]


class Page(Schema):
    next_cursor: str | None


class IssuePage(Page):
    items: list[IssueOut]


class CommentPage(Page):
    items: list[CommentOut]


class RunPage(Page):
    items: list[RunOut]


class AttemptPage(Page):
    items: list[AttemptOut]


class ArtifactPage(Page):
    items: list[ArtifactOut]


class WorkflowPage(Page):
    items: list[WorkflowOut]
