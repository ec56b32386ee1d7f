"""Routes agents talk back through (SPEC §5, §8): outcome intents, member nodes, comments, artifacts.

An agent authenticates with its attempt's task token and may touch only its own attempt, run and
issue; operators use the same comment and artifact routes with their own permissions.
"""

from __future__ import annotations

from uuid import UUID

from ninja import Schema, Status
from ninja.security import HttpBearer

from chorus_site.api import SessionCookieAuth, TokenAuth, act, require_perm
from chorus_site.api_input import NO_CONTROL, Enum, Text
from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError
from chorus_site.idempotency import idempotent_call
from chorus_site.redaction import ingest
from chorus_site.throttling import client_ident, credential_gate

from . import engine, selectors as sel, services, states
from .api import ERRORS, router
from .models import Attempt, Issue
from .task_tokens import attempt_for_task_token


class TaskTokenAuth(HttpBearer):
    def authenticate(self, request, token):
        credential_gate(client_ident(request), token)
        return attempt_for_task_token(token)


AGENT_OR_OPERATOR = [SessionCookieAuth(), TokenAuth(), TaskTokenAuth()]


def _agent_text(body):
    """What an agent posts (outcome summary, member prompts, comment, artifact) is agent text: the
    whole validated body is made storable and redacted at the entry point, before any of it is
    stored or recorded (issue 8), so a new field cannot miss it."""
    return type(body)(**ingest(body.dict()))


def _agent_call(request, *, route: str, body: dict, action):
    """Idempotency for an agent's post (its key space is its attempt)."""
    attempt = request.auth
    code, answer, _ = idempotent_call(user=None, scope=f"attempt:{attempt.pk}", route=route,
                                      key=request.headers.get("Idempotency-Key"), body=body,
                                      action=lambda: action(attempt))
    return Status(code, answer)


class AgentOutcomeIn(Schema):
    intent: str = Enum(states.OUTCOMES)
    ref: str | None = None
    summary: str | None = None


class NodeIn(Schema):
    key: str = Text(100)
    prompt: str


class NodesIn(Schema):
    nodes: list[NodeIn]


class CommentIn(Schema):
    body: str
    type: str = Enum(states.COMMENT_TYPES, "comment")
    run: UUID | None = None
    attempt: UUID | None = None
    issue: UUID | None = None


class ArtifactIn(Schema):
    kind: str = Enum(states.ARTIFACT_KINDS)
    name: str = Text(255, pattern=NO_CONTROL)
    content: str
    issue: UUID | None = None
    run: UUID | None = None
    attempt: UUID | None = None


@router.post("/attempts/{attempt_id}/outcome", auth=TaskTokenAuth(), response={200: dict, **ERRORS},
             summary="Outcome intent of an attempt (its task token)")
def attempt_outcome(request, attempt_id: UUID, body: AgentOutcomeIn):
    if not isinstance(request.auth, Attempt) or request.auth.pk != attempt_id:
        raise ApplicationError("forbidden", "a task token may report only its own attempt")
    body = _agent_text(body)
    return _agent_call(request, route=f"attempts.outcome:{attempt_id}", body=body.dict(),
                       action=lambda attempt: (200, {"recorded": services.attempt_record_outcome(
                           attempt_id=attempt.pk, intent=body.intent, ref=body.ref, summary=body.summary)}))


@router.post("/runs/{run_id}/nodes", auth=TaskTokenAuth(), response={200: dict, **ERRORS},
             summary="Adaptive lead adds member nodes (its task token)")
def run_add_nodes(request, run_id: UUID, body: NodesIn):
    attempt = request.auth
    task = attempt.task
    if task.node.run_id != run_id or not task.leader:
        raise ApplicationError("forbidden", "only the lead of this adaptive run may add members")
    body = _agent_text(body)

    def add(attempt):
        return 200, engine.run_add_members(run_id=run_id, lead_task=task, nodes=[n.dict() for n in body.nodes])

    return _agent_call(request, route=f"runs.nodes:{run_id}", body=body.dict(), action=add)


def _scope_of_agent(attempt: Attempt, issue_id, run_id) -> None:
    run = attempt.task.node.run
    if (issue_id and issue_id != run.issue_id) or (run_id and run_id != run.pk):
        raise ApplicationError("forbidden", "a task token may write only to its own run and issue")


@router.post("/issues/{issue_id}/comments", auth=AGENT_OR_OPERATOR, response={201: dict, **ERRORS},
             summary="Comment on an issue (operator, or an agent with its task token)")
def issue_comment(request, issue_id: UUID, body: CommentIn):
    if not Issue.objects.filter(pk=issue_id).exists():
        raise ApplicationError("not_found", "not found")
    if isinstance(request.auth, Attempt):
        attempt = request.auth
        _scope_of_agent(attempt, issue_id, body.run)
        body = _agent_text(body)

        def post(attempt):
            comment = services.comment_add(issue_id=issue_id, body=body.body, author=f"agent:{attempt.task_id}",
                                           type=body.type, source_task_id=attempt.task_id,
                                           source_attempt_id=attempt.pk)
            return 201, _json(sel.comment_out(comment))

        return _agent_call(request, route=f"issues.comment:{issue_id}", body=_json(body.dict()), action=post)

    def post_as_user(user, key):
        comment = services.comment_add(issue_id=issue_id, body=body.body, author=user.get_username(), type=body.type)
        audit_record(actor=user, action="issue.comment", target=f"issue:{issue_id}", outcome="commented",
                     client="api", idempotency_key=key)
        return _json(sel.comment_out(comment))

    return act(request, perm="executions.add_comment", route=f"issues.comment:{issue_id}", body=_json(body.dict()),
               status=201, action=post_as_user)


@router.post("/artifacts", auth=AGENT_OR_OPERATOR, response={201: dict, **ERRORS},
             summary="Attach an artifact (operator, or an agent with its task token)")
def artifact_create(request, body: ArtifactIn):
    if isinstance(request.auth, Attempt):
        attempt = request.auth
        run = attempt.task.node.run
        _scope_of_agent(attempt, body.issue, body.run)
        body = _agent_text(body)

        def post(attempt):
            artifact = services.artifact_add(issue_id=run.issue_id, run_id=run.pk, attempt_id=attempt.pk,
                                             kind=body.kind, name=body.name, content=body.content)
            return 201, _json(sel.artifact_out(artifact))

        return _agent_call(request, route="artifacts.create", body=_json(body.dict()), action=post)
    if not body.issue:
        raise ApplicationError("bad_request", "issue is required")

    def post_as_user(user, key):
        artifact = services.artifact_add(issue_id=body.issue, run_id=body.run, attempt_id=body.attempt,
                                         kind=body.kind, name=body.name, content=body.content)
        audit_record(actor=user, action="artifact.create", target=f"artifact:{artifact.pk}", outcome="attached",
                     client="api", idempotency_key=key)
        return _json(sel.artifact_out(artifact))

    require_perm(request, "executions.add_artifact")
    return act(request, perm="executions.add_artifact", route="artifacts.create", body=_json(body.dict()), status=201,
               action=post_as_user)


def _json(value):
    import json

    return json.loads(json.dumps(value, default=str))


