"""Reads of executions: querysets with their joins and the run graph."""

from __future__ import annotations

from django.db.models import Prefetch, Q, QuerySet

from .models import AgentTask, Approval, Artifact, Attempt, Comment, Issue, Run, RunNode, WorkflowDefinition


def issues_qs() -> QuerySet:
    return Issue.objects.select_related("assignee")


def runs_qs() -> QuerySet:
    return Run.objects.select_related("issue", "workflow_revision__workflow")


def runs_list_qs() -> QuerySet:
    """What run_out reads of a page: the run and its issue's title (not the issue's body, not the
    workflow revision the detail's graph uses)."""
    return Run.objects.select_related("issue").defer("issue__body", "issue__acceptance_criteria")


def attempts_qs() -> QuerySet:
    return Attempt.objects.all()  # attempt_out reads ids only: no join (issue 9)


def artifacts_qs() -> QuerySet:
    return Artifact.objects.all()


def workflows_qs() -> QuerySet:
    return WorkflowDefinition.objects.prefetch_related("revisions")


def tasks_qs() -> QuerySet:
    return AgentTask.objects.select_related("node__run", "session")


def issue_out(i: Issue) -> dict:
    return {"id": i.id, "title": i.title, "body": i.body, "acceptance_criteria": i.acceptance_criteria,
            "completion_policy": i.completion_policy, "status": i.status,
            "assignee": i.assignee.get_username() if i.assignee else None, "version": i.version,
            "created_at": i.created_at, "updated_at": i.updated_at}


def comment_out(c: Comment) -> dict:
    return {"id": c.id, "issue_id": c.issue_id, "type": c.type, "author": c.author, "body": c.body,
            "source_task_id": c.source_task_id, "source_attempt_id": c.source_attempt_id, "created_at": c.created_at}


def artifact_out(a: Artifact) -> dict:
    return {"id": a.id, "issue_id": a.issue_id, "run_id": a.run_id, "attempt_id": a.attempt_id, "kind": a.kind,
            "name": a.name, "sha256": a.sha256, "size": a.size, "created_at": a.created_at}


def attempt_out(a: Attempt) -> dict:
    return {
        "id": a.id, "task_id": a.task_id, "number": a.number, "state": a.state, "connection_id": a.connection_id,
        "session_id": a.session_id, "turn_id": a.turn_id, "backend": a.backend,
        "provider_session_id": a.provider_session_id, "cwd": a.cwd, "heartbeat_at": a.heartbeat_at,
        "outcome": a.outcome, "failure_code": a.failure_code, "failure_message": a.failure_message,
        "usage": a.usage, "started_at": a.started_at, "ended_at": a.ended_at,
    }


def task_out(t: AgentTask, attempts=None) -> dict:
    out = {"id": t.id, "node_id": t.node_id, "ordinal": t.ordinal, "status": t.status, "retry_of": t.retry_of_id,
           "retried_by": [r.pk for r in t.retries.all()],
           "leader": t.leader, "session_id": t.session_id, "current_attempt_id": t.current_attempt_id,
           "result": t.result, "error": t.error, "wait_reason": t.wait_reason}
    if attempts is not None:
        out["attempts"] = [attempt_out(a) for a in attempts]
    return out


def run_out(r: Run, *, graph: bool = False) -> dict:
    out = {
        "id": r.id, "issue_id": r.issue_id, "issue_title": r.issue.title, "mode": r.mode, "state": r.state,
        "workflow_revision_id": r.workflow_revision_id, "parent_run_id": r.parent_run_id,
        "parent_node_id": r.parent_node_id, "rerun_of": r.rerun_of_id, "trigger": r.trigger, "input": r.input,
        "output": r.output, "target": r.target, "policy": r.policy, "wait_reason": r.wait_reason,
        "wait_detail": r.wait_detail, "failure_code": r.failure_code, "failure_message": r.failure_message,
        "version": r.version, "created_at": r.created_at, "started_at": r.started_at,
        "completed_at": r.completed_at,
    }
    if graph:
        out["nodes"] = run_graph(r)
        out["reruns"] = [x.pk for x in r.reruns.order_by("id")]
    return out


def run_graph(run: Run) -> list[dict]:
    """nodes → tasks → attempts in three queries."""
    attempts = Attempt.objects.order_by("number")
    tasks = AgentTask.objects.order_by("ordinal").prefetch_related(Prefetch("attempts", queryset=attempts),
                                                                     "retries")
    nodes = RunNode.objects.filter(run=run).order_by("id").prefetch_related(Prefetch("tasks", queryset=tasks))
    return [
        {"id": n.id, "key": n.key, "type": n.type, "state": n.state, "iteration": n.iteration,
         "depends_on": n.depends_on, "wait_reason": n.wait_reason, "wait_detail": n.wait_detail,
         "failure_code": n.failure_code, "failure_message": n.failure_message,
         "tasks": [task_out(t, attempts=list(t.attempts.all())) for t in n.tasks.all()]}
        for n in nodes
    ]


def workflow_out(w: WorkflowDefinition) -> dict:
    return {"id": w.id, "name": w.name, "description": w.description, "created_at": w.created_at,
            "revisions": [{"id": r.id, "number": r.number, "spec": r.spec, "created_at": r.created_at}
                          for r in w.revisions.all()]}


def inbox_for(user) -> dict:
    """Review items (issues in review) and the approvals this user may decide."""
    review = list(issues_qs().filter(status="in_review").order_by("-id")[:200])
    approvals = (Approval.objects.filter(status="pending")
                 .filter(Q(approver_user=user) | Q(approver_group__in=user.groups.all())
                         | Q(approver_user__isnull=True, approver_group__isnull=True))
                 .select_related("node__run").order_by("-id")[:200])
    return {
        "review": [issue_out(i) for i in review],
        "approvals": [{"id": a.id, "node_id": a.node_id, "run_id": a.node.run_id if a.node else None,
                       "turn_id": a.turn_id, "prompt": a.prompt, "status": a.status, "version": a.version,
                       "created_at": a.created_at} for a in approvals],
    }


def attempt_evidence(run: Run) -> list[dict]:
    """The four kinds of evidence of each attempt, kept apart (SPEC §1 rule 4): tool events, the final
    reply, the attempt's outcome and the issue's acceptance.  None implies another."""
    from chorus_site.models import Event

    attempts = list(Attempt.objects.filter(task__node__run=run).select_related("turn", "task__node")
                    .order_by("task__node__id", "task__ordinal", "number"))
    tools: dict = {}
    turn_ids = [str(a.turn_id) for a in attempts if a.turn_id]
    streams = {f"session:{a.turn.session_id}" for a in attempts if a.turn_id}
    if turn_ids:
        for data in (Event.objects.filter(stream__in=streams, kind="turn.output", data__type="tool",
                                          data__id__in=turn_ids).values_list("data", flat=True)[:2000]):
            tools.setdefault(data.get("id"), []).append((data.get("data") or {}).get("name") or "tool")
    acceptance = {"in_review": "awaiting review", "done": "accepted", "cancelled": "cancelled"}.get(
        run.issue.status, f"not delivered ({run.issue.status})")
    return [{
        "attempt": a, "node": a.task.node.key, "task": a.task.ordinal,
        "tools": tools.get(str(a.turn_id), []),
        "final_reply": (a.turn.final_reply if a.turn_id else "") or "",
        "outcome": a.outcome or {}, "acceptance": acceptance,
    } for a in attempts]
