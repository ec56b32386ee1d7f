"""Read routes of executions (SPEC §8): issues, comments, inbox, workflows, runs, tasks, attempts, artifacts."""

from __future__ import annotations

from uuid import UUID

from django.http import HttpResponse
from ninja import Router

from chorus_site.api import ErrorBody, filter_or_400, paginate, query_params, require_ops
from chorus_site.audit import audit_record
from chorus_site.permissions import can_view_diagnostics
from chorus_site.redaction import redact
from sessions_app.selectors import get_or_404

from . import selectors as sel
from .filters import ArtifactFilter, AttemptFilter, IssueFilter, RunFilter
from .schemas import (
    ArtifactOut, ArtifactPage, AttemptOut, AttemptPage, CommentPage, InboxOut, IssueOut, IssuePage, RunDetailOut,
    RunPage, TaskOut, WorkflowPage,
)

router = Router(tags=["executions"])
ERRORS = {400: ErrorBody, 401: ErrorBody, 403: ErrorBody, 404: ErrorBody, 409: ErrorBody}


@router.get("/issues", response={200: IssuePage, **ERRORS}, summary="List issues")
def issues_list(request, status: str = None, completion_policy: str = None, q: str = None, limit: int = 50,
                cursor: str = None):
    require_ops(request)
    qs = filter_or_400(IssueFilter, query_params(request, "status", "completion_policy", "q"), sel.issues_qs())
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.issue_out)


@router.get("/issues/{issue_id}", response={200: IssueOut, **ERRORS}, summary="Issue detail")
def issue_detail(request, issue_id: UUID):
    require_ops(request)
    return sel.issue_out(get_or_404(sel.issues_qs(), issue_id))


@router.get("/issues/{issue_id}/comments", response={200: CommentPage, **ERRORS}, summary="Comments of an issue")
def issue_comments(request, issue_id: UUID, limit: int = 50, cursor: str = None):
    require_ops(request)
    issue = get_or_404(sel.issues_qs(), issue_id)
    return paginate(issue.comments.all(), limit=limit, cursor=cursor, descending=False, serialize=sel.comment_out)


@router.get("/inbox", response={200: InboxOut, **ERRORS}, summary="Review items and approvals for the caller")
def inbox(request):
    return sel.inbox_for(require_ops(request))


@router.get("/workflows", response={200: WorkflowPage, **ERRORS}, summary="Workflow definitions and revisions")
def workflows_list(request, limit: int = 50, cursor: str = None):
    require_ops(request)
    return paginate(sel.workflows_qs(), limit=limit, cursor=cursor, serialize=sel.workflow_out)


@router.get("/runs", response={200: RunPage, **ERRORS}, summary="List runs")
def runs_list(request, state: str = None, mode: str = None, issue: UUID = None, created_after: str = None,
              created_before: str = None, q: str = None, limit: int = 50, cursor: str = None):
    require_ops(request)
    qs = filter_or_400(RunFilter, query_params(request, "state", "mode", "issue", "created_after", "created_before", "q"),
                       sel.runs_qs())
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.run_out)


@router.get("/runs/{run_id}", response={200: RunDetailOut, **ERRORS}, summary="Run detail with its graph")
def run_detail(request, run_id: UUID):
    require_ops(request)
    return sel.run_out(get_or_404(sel.runs_qs(), run_id), graph=True)


@router.get("/tasks/{task_id}", response={200: TaskOut, **ERRORS}, summary="Agent task with its attempts")
def task_detail(request, task_id: UUID):
    require_ops(request)
    task = get_or_404(sel.tasks_qs(), task_id)
    return sel.task_out(task, attempts=list(task.attempts.order_by("number")))


@router.get("/attempts", response={200: AttemptPage, **ERRORS}, summary="List attempts")
def attempts_list(request, task: UUID = None, state: str = None, connection: UUID = None, limit: int = 50,
                  cursor: str = None):
    require_ops(request)
    qs = filter_or_400(AttemptFilter, query_params(request, "task", "state", "connection"), sel.attempts_qs())
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.attempt_out)


@router.get("/attempts/{attempt_id}", response={200: AttemptOut, **ERRORS}, summary="Attempt detail")
def attempt_detail(request, attempt_id: UUID):
    require_ops(request)
    return sel.attempt_out(get_or_404(sel.attempts_qs(), attempt_id))


@router.get("/artifacts", response={200: ArtifactPage, **ERRORS}, summary="List artifacts")
def artifacts_list(request, issue: UUID = None, run: UUID = None, attempt: UUID = None, kind: str = None,
                   limit: int = 50, cursor: str = None):
    require_ops(request)
    qs = filter_or_400(ArtifactFilter, query_params(request, "issue", "run", "attempt", "kind"), sel.artifacts_qs())
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.artifact_out)


@router.get("/artifacts/{artifact_id}", response={200: ArtifactOut, **ERRORS}, summary="Artifact metadata")
def artifact_detail(request, artifact_id: UUID):
    require_ops(request)
    return sel.artifact_out(get_or_404(sel.artifacts_qs(), artifact_id))


@router.get("/artifacts/{artifact_id}/content", response={200: str, **ERRORS},
            summary="Artifact content (raw for ops_diagnostics, audited; redacted for other roles)")
def artifact_content(request, artifact_id: UUID):
    user = require_ops(request)
    artifact = get_or_404(sel.artifacts_qs(), artifact_id)
    raw = can_view_diagnostics(user)
    if raw:
        audit_record(actor=user, action="artifact.view_raw", target=f"artifact:{artifact.id}", outcome="shown",
                     client="api")
    body = artifact.content if raw else redact(artifact.content)
    response = HttpResponse(body, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'inline; filename="{artifact.name.replace(chr(34), "")}"'
    response["X-Content-Type-Options"] = "nosniff"
    return response
