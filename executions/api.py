"""Read routes of executions (SPEC §8): issues, comments, inbox, workflows, runs, tasks, attempts, artifacts."""

from __future__ import annotations

from uuid import UUID

from django.http import HttpResponse
from django.utils.http import content_disposition_header
from ninja import Path, Router, Schema

from chorus_site.api import ErrorBody, act, filter_or_400, paginate, query_params, require_ops
from chorus_site.api_input import Count, Enum, Text
from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError
from chorus_site.permissions import can_view_diagnostics
from chorus_site.redaction import clean_text, redact
from sessions_app.selectors import get_or_404
from sessions_app.troubleshooting import export_options, export_response

from . import actions, engine, services, states, troubleshooting, workflows
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
                       sel.runs_list_qs())
    return paginate(qs, limit=limit, cursor=cursor, serialize=sel.run_out)


@router.get("/runs/{run_id}", response={200: RunDetailOut, **ERRORS}, summary="Run detail with its graph")
def run_detail(request, run_id: UUID):
    require_ops(request)
    return sel.run_out(get_or_404(sel.runs_qs(), run_id), graph=True)


@router.get("/runs/{run_id}/troubleshooting", response={200: dict, **ERRORS},
            summary="Troubleshooting record (§9): JSON, or Markdown with ?format=md; redacted unless ?redacted=0")
def run_troubleshooting(request, run_id: UUID, format: str = "json", redacted: bool = True, details: bool = False):
    """``?redacted=0`` and ``?details=1`` are for ops_diagnostics (403 otherwise) and audited."""
    user = require_ops(request)
    run = get_or_404(sel.runs_qs(), run_id)
    export_options(user, redacted=redacted, details=details)
    record = troubleshooting.run_record(run, redacted=redacted, include_details=details)
    return export_response(user=user, record=record, target=f"run:{run.pk}", filename=f"run-{run.pk}", fmt=format,
                           markdown=troubleshooting.record_markdown)


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
    # The name is free text: control characters (CR/LF would split the header) are dropped and a
    # non-ASCII name is sent as RFC 6266 filename*= (a header must be Latin-1).
    safe_name = "".join(ch for ch in artifact.name if ch.isprintable()) or "artifact"
    response["Content-Disposition"] = content_disposition_header(False, safe_name)
    response["X-Content-Type-Options"] = "nosniff"
    return response


# ---------------------------------------------------------------- acting routes
class IssueIn(Schema):
    title: str = Text(255)
    body: str = ""
    acceptance_criteria: str = ""
    completion_policy: str = Enum(states.COMPLETION_POLICIES, "review")


class RunIn(Schema):
    issue: UUID
    mode: str = Enum(states.RUN_MODES)
    workflow_revision: UUID | None = None
    input: dict = {}
    target: dict | None = None
    policy: dict | None = None


class RunActionIn(Schema):
    expected_version: int | None = Count(None)
    reason: str | None = None


class RerunIn(Schema):
    input: dict | None = None
    reason: str | None = None


class WorkflowIn(Schema):
    name: str = Text(100)
    description: str = ""
    spec: dict


class RevisionIn(Schema):
    spec: dict


@router.post("/issues", response={201: dict, **ERRORS}, summary="Create an issue")
def issue_create(request, body: IssueIn):
    def create(user, key):
        issue = services.issue_create(title=body.title, body=body.body, acceptance_criteria=body.acceptance_criteria,
                                      completion_policy=body.completion_policy, actor=user)
        audit_record(actor=user, action="issue.create", target=f"issue:{issue.pk}", outcome="created",
                     client="api", idempotency_key=key)
        return sel.issue_out(issue) | {"id": str(issue.pk)}

    if not body.title.strip():
        raise ApplicationError("bad_request", "title must not be empty")
    return act(request, perm="executions.add_issue", route="issues.create", body=body.dict(), status=201,
               action=lambda user, key: _jsonable(create(user, key)))


@router.post("/runs", response={201: dict, **ERRORS}, summary="Start a run")
def run_start(request, body: RunIn):
    def start(user, key):
        run = engine.run_start(issue_id=body.issue, mode=body.mode, input=body.input,
                               workflow_revision_id=body.workflow_revision, target=body.target, policy=body.policy,
                               actor=user, idempotency_key=key)
        return {"run": str(run.pk), "state": run.state, "version": run.version}

    return act(request, perm="executions.start_run", route="runs.start", body=_jsonable(body.dict()), status=201,
               action=start)


def _run_action(request, run_id, name, body, fn):
    return act(request, perm=f"executions.{name}_run", route=f"runs.{name}:{run_id}", body=_jsonable(body.dict()),
               action=lambda user, key: fn(actor=user, run_id=run_id, idempotency_key=key,
                                           **{k: v for k, v in body.dict().items() if v is not None}))


@router.post("/runs/{run_id}/pause", response={200: dict, **ERRORS}, summary="Pause: no new dispatch (§4.7)")
def run_pause(request, run_id: UUID, body: RunActionIn):
    return _run_action(request, run_id, "pause", body, actions.run_pause)


@router.post("/runs/{run_id}/resume", response={200: dict, **ERRORS}, summary="Resume a paused run")
def run_resume(request, run_id: UUID, body: RunActionIn):
    return _run_action(request, run_id, "resume", body, actions.run_resume)


@router.post("/runs/{run_id}/cancel", response={200: dict, **ERRORS}, summary="Cancel: interrupt every attempt")
def run_cancel(request, run_id: UUID, body: RunActionIn):
    return _run_action(request, run_id, "cancel", body, actions.run_cancel)


@router.post("/runs/{run_id}/rerun", response={200: dict, **ERRORS}, summary="Rerun a finished run")
def run_rerun(request, run_id: UUID, body: RerunIn):
    return _run_action(request, run_id, "rerun", body, actions.run_rerun)


@router.post("/workflows", response={201: dict, **ERRORS}, summary="Create a workflow with its first revision")
def workflow_create(request, body: WorkflowIn):
    def create(user, key):
        revision = workflows.workflow_create(name=body.name, description=body.description, spec=body.spec,
                                             actor=user)
        audit_record(actor=user, action="workflow.create", target=f"workflow:{revision.workflow_id}",
                     outcome="created", client="api", idempotency_key=key)
        return {"workflow": str(revision.workflow_id), "revision": str(revision.pk), "number": revision.number}

    return act(request, perm="executions.add_workflowdefinition", route="workflows.create", body=body.dict(),
               status=201, action=create)


@router.post("/workflows/{workflow_id}/revisions", response={201: dict, **ERRORS},
             summary="Add an immutable revision")
def workflow_revise(request, workflow_id: UUID, body: RevisionIn):
    def revise(user, key):
        revision = workflows.workflow_revise(workflow_id=workflow_id, spec=body.spec, actor=user)
        audit_record(actor=user, action="workflow.revise", target=f"workflow:{workflow_id}",
                     outcome=f"revision {revision.number}", client="api", idempotency_key=key)
        return {"workflow": str(workflow_id), "revision": str(revision.pk), "number": revision.number}

    return act(request, perm="executions.add_workflowrevision", route=f"workflows.revise:{workflow_id}",
               body=body.dict(), status=201, action=revise)


def _jsonable(value):
    import json

    return json.loads(json.dumps(value, default=str))


class DecisionIn(Schema):
    decision: str = Enum(["approved", "rejected"])
    expected_version: int | None = Count(None)
    reason: str | None = None


class ReviewIn(Schema):
    expected_version: int | None = Count(None)
    reason: str | None = None


class TaskActionIn(Schema):
    reason: str | None = None


@router.post("/runs/{run_id}/signals/{name}", response={200: dict, **ERRORS}, summary="Deliver a signal (§4.7)")
def run_signal(request, run_id: UUID, name: str = Path(..., max_length=100), body: TaskActionIn = None):
    name = clean_text(name)  # a path parameter does not go through the API's parser
    reason = body.reason if body else None
    return act(request, perm="executions.signal_run", route=f"runs.signal:{run_id}:{name}", body={"reason": reason},
               action=lambda user, key: actions.run_signal(actor=user, run_id=run_id, name=name, reason=reason,
                                                           idempotency_key=key))


@router.post("/approvals/{approval_id}/decide", response={200: dict, **ERRORS}, summary="Decide an approval")
def approval_decide(request, approval_id: UUID, body: DecisionIn):
    return act(request, perm="executions.decide_approval", route=f"approvals.decide:{approval_id}", body=body.dict(),
               action=lambda user, key: actions.approval_decide(
                   actor=user, approval_id=approval_id, decision=body.decision,
                   expected_version=body.expected_version, reason=body.reason, idempotency_key=key))


@router.post("/issues/{issue_id}/accept", response={200: dict, **ERRORS}, summary="Accept an issue in review")
def issue_accept(request, issue_id: UUID, body: ReviewIn):
    return act(request, perm="executions.accept_issue", route=f"issues.accept:{issue_id}", body=body.dict(),
               action=lambda user, key: actions.issue_review(actor=user, issue_id=issue_id, accept=True,
                                                             expected_version=body.expected_version,
                                                             reason=body.reason, idempotency_key=key))


@router.post("/issues/{issue_id}/reject", response={200: dict, **ERRORS},
             summary="Reject: back to in progress, starting no execution")
def issue_reject(request, issue_id: UUID, body: ReviewIn):
    return act(request, perm="executions.reject_issue", route=f"issues.reject:{issue_id}", body=body.dict(),
               action=lambda user, key: actions.issue_review(actor=user, issue_id=issue_id, accept=False,
                                                             expected_version=body.expected_version,
                                                             reason=body.reason, idempotency_key=key))


@router.post("/issues/{issue_id}/reopen", response={200: dict, **ERRORS},
             summary="Reopen a done issue: back to in progress, starting no execution")
def issue_reopen(request, issue_id: UUID, body: ReviewIn):
    return act(request, perm="executions.reopen_issue", route=f"issues.reopen:{issue_id}", body=body.dict(),
               action=lambda user, key: actions.issue_reopen(actor=user, issue_id=issue_id,
                                                             expected_version=body.expected_version,
                                                             reason=body.reason, idempotency_key=key))


@router.post("/tasks/{task_id}/retry", response={200: dict, **ERRORS}, summary="A new task for the node")
def task_retry(request, task_id: UUID, body: TaskActionIn = None):
    reason = body.reason if body else None
    return act(request, perm="executions.retry_task", route=f"tasks.retry:{task_id}", body={"reason": reason},
               action=lambda user, key: actions.task_retry(actor=user, task_id=task_id, reason=reason,
                                                           idempotency_key=key))


@router.post("/tasks/{task_id}/cancel", response={200: dict, **ERRORS}, summary="Cancel a task")
def task_cancel(request, task_id: UUID, body: TaskActionIn = None):
    reason = body.reason if body else None
    return act(request, perm="executions.cancel_task", route=f"tasks.cancel:{task_id}", body={"reason": reason},
               action=lambda user, key: actions.task_cancel(actor=user, task_id=task_id, reason=reason,
                                                            idempotency_key=key))
