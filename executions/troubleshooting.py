"""Troubleshooting record of a run (SPEC §9): everything an engineer needs to follow what happened.

The issue and whether its acceptance is still pending; the run (mode, workflow revision, rerun_of,
state, wait and failure); every node with its tasks and attempts in order, each labelled with the
retry level that made it — a task with ``retry_of`` is a *policy* retry (§6.3), an attempt numbered
above 1 an *infrastructure* retry — and for each attempt the portal and backend session, the
connection and host, backend, provider, model, the turn with its stop state and wake error, and
timestamps; the last event cursor of the run's stream and of every session stream; artifacts and
test logs with links. Failed attempts stay beside the one that succeeded.

Redaction and export rules are shared with the session record (sessions_app.troubleshooting).
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.http import Http404

from sessions_app import troubleshooting as st
from sessions_app.models import Session, Turn

from . import selectors
from .models import AgentTask, Artifact, Attempt, Comment, Run, RunNode

ARTIFACT_LINK = "/api/v1/artifacts/{id}/content"


def acceptance_out(issue) -> dict:
    """Acceptance is a separate act (§6.5): pending until the issue is done."""
    state = {"in_review": "awaiting_review", "done": "accepted", "cancelled": "cancelled"}.get(issue.status,
                                                                                          "not_delivered")
    return {"pending": issue.status not in {"done", "cancelled"}, "state": state, "issue_status": issue.status}


def issue_out(issue, *, redacted: bool) -> dict:
    return {"id": str(issue.id), "title": issue.title, "status": issue.status,
            "completion_policy": issue.completion_policy, "acceptance_criteria": issue.acceptance_criteria,
            "acceptance": acceptance_out(issue), "body": st.text_out(issue.body, redacted=redacted),
            "version": issue.version}


def artifact_out(a: Artifact) -> dict:
    return {"id": str(a.id), "name": a.name, "kind": a.kind, "sha256": a.sha256, "size": a.size,
            "attempt_id": st.sid(a.attempt_id), "run_id": st.sid(a.run_id), "created_at": st.iso(a.created_at),
            "link": ARTIFACT_LINK.format(id=a.id)}


def _run_input(value: dict, *, redacted: bool) -> dict:
    value = st.blob(value or {}, redacted=redacted)
    return {k: st.text_out(v, redacted=redacted) if isinstance(v, str) and len(v) > st.PREVIEW_CHARS else v
            for k, v in value.items()}


def run_out(run: Run, cursors: dict[str, int], *, redacted: bool) -> dict:
    revision = run.workflow_revision
    return {
        "id": str(run.id), "mode": run.mode, "state": run.state, "trigger": run.trigger,
        "workflow_revision": ({"id": str(revision.id), "workflow": revision.workflow.name,
                               "number": revision.number} if revision else None),
        "rerun_of": st.sid(run.rerun_of_id), "reruns": [str(pk) for pk in run.reruns.order_by("id")
                                                        .values_list("id", flat=True)],
        "parent_run": st.sid(run.parent_run_id), "parent_node": st.sid(run.parent_node_id),
        "child_runs": [str(pk) for pk in run.child_runs.order_by("id").values_list("id", flat=True)],
        "wait_reason": run.wait_reason, "wait_detail": st.blob(run.wait_detail, redacted=redacted),
        "failure_code": run.failure_code, "failure_message": run.failure_message,
        "input": _run_input(run.input, redacted=redacted), "target": st.blob(run.target, redacted=redacted),
        "policy": st.blob(run.policy, redacted=redacted), "version": run.version,
        "created_at": st.iso(run.created_at), "started_at": st.iso(run.started_at),
        "completed_at": st.iso(run.completed_at), "event_cursor": cursors.get(run.stream, 0),
    }


def attempt_out(a: Attempt, previous: Attempt | None, turns: list[Turn], cursors: dict[str, int],
                artifacts: list[dict], *, redacted: bool, include_details: bool) -> dict:
    session: Session | None = a.session
    connection = a.connection or (session.connection if session else None)
    primary = next((t for t in turns if t.id == a.turn_id), turns[-1] if turns else None)
    return {
        "id": str(a.id), "number": a.number,
        "made_by": "infrastructure_retry" if a.number > 1 else "first_attempt",
        # a later attempt in another session: the fresh fallback of §6.4 (a new conversation)
        "fresh_session": bool(previous and previous.session_id != a.session_id),
        "state": a.state, "outcome": st.blob(a.outcome, redacted=redacted),
        "failure_code": a.failure_code, "failure_message": a.failure_message,
        "session_id": st.sid(a.session_id),
        "backend_session_id": (session.backend_session_id if session else None) or a.provider_session_id or None,
        "provider_session_id": a.provider_session_id,
        "session": st.session_out(session, cursors) if session else None,
        "connection": st.connection_out(connection), "host": connection.host if connection else None,
        "backend": a.backend or (session.backend if session else ""),
        "provider": session.provider if session else "", "model": session.model if session else "",
        "cwd": a.cwd or (session.cwd if session else ""),
        "turn_id": st.sid(a.turn_id),
        "turn": st.turn_out(primary, redacted=redacted, include_details=include_details) if primary else None,
        "other_turns": [st.turn_out(t, redacted=redacted, include_details=include_details)
                        for t in turns if t is not primary],
        "usage": st.blob(a.usage, redacted=redacted), "artifacts": artifacts,
        "heartbeat_at": st.iso(a.heartbeat_at), "created_at": st.iso(a.created_at),
        "started_at": st.iso(a.started_at), "ended_at": st.iso(a.ended_at),
    }


def run_record(run: Run, *, redacted: bool = True, include_details: bool = False) -> dict:
    """The record of one run; ``include_details`` only for a viewer with ops_diagnostics."""
    run = selectors.runs_qs().select_related("rerun_of").get(pk=run.pk)
    nodes = list(RunNode.objects.filter(run=run).order_by("id"))
    tasks = list(AgentTask.objects.filter(node__run=run).order_by("node_id", "ordinal"))
    attempts = list(Attempt.objects.filter(task__node__run=run).select_related("connection", "session__connection")
                    .order_by("task_id", "number"))
    attempt_ids = [a.id for a in attempts]
    linked = list(Turn.objects.filter(Q(id__in=[a.turn_id for a in attempts if a.turn_id])
                                      | Q(attempt_id__in=attempt_ids)).order_by("created_at", "id"))
    turns_by_attempt = {a.id: [t for t in linked if t.attempt_id == a.id or t.id == a.turn_id] for a in attempts}
    artifacts = list(Artifact.objects.filter(Q(run=run) | Q(attempt_id__in=attempt_ids))
                     .order_by("created_at", "id"))
    artifacts_by_attempt: dict = {}
    for artifact in artifacts:
        artifacts_by_attempt.setdefault(artifact.attempt_id, []).append(artifact_out(artifact))
    session_ids = {a.session_id for a in attempts if a.session_id} | {t.session_id for t in tasks if t.session_id}
    cursors = st.stream_cursors([run.stream] + [f"session:{pk}" for pk in sorted(map(str, session_ids))])

    attempts_by_task: dict = {}
    for a in attempts:
        attempts_by_task.setdefault(a.task_id, []).append(a)
    tasks_by_node: dict = {}
    for task in tasks:
        rows, previous = [], None
        for a in attempts_by_task.get(task.id, []):
            rows.append(attempt_out(a, previous, turns_by_attempt.get(a.id, []), cursors,
                                    artifacts_by_attempt.get(a.id, []), redacted=redacted,
                                    include_details=include_details))
            previous = a
        tasks_by_node.setdefault(task.node_id, []).append({
            "id": str(task.id), "ordinal": task.ordinal,
            "made_by": "policy_retry" if task.retry_of_id else "first_task", "retry_of": st.sid(task.retry_of_id),
            "status": task.status, "leader": task.leader, "error": task.error, "wait_reason": task.wait_reason,
            "session_id": st.sid(task.session_id), "current_attempt_id": st.sid(task.current_attempt_id),
            "result": st.blob(task.result, redacted=redacted), "created_at": st.iso(task.created_at),
            "attempts": rows,
        })
    comments = Comment.objects.filter(Q(source_attempt_id__in=attempt_ids) | Q(source_task__node__run=run))
    record = st.record_header("run", redacted=redacted, include_details=include_details)
    record.update({
        "issue": issue_out(run.issue, redacted=redacted),
        "run": run_out(run, cursors, redacted=redacted),
        "event_cursors": cursors,
        "nodes": [{"id": str(n.id), "key": n.key, "type": n.type, "state": n.state, "iteration": n.iteration,
                   "depends_on": n.depends_on, "wait_reason": n.wait_reason,
                   "wait_detail": st.blob(n.wait_detail, redacted=redacted), "failure_code": n.failure_code,
                   "failure_message": n.failure_message, "tasks": tasks_by_node.get(n.id, [])} for n in nodes],
        "artifacts": [artifact_out(a) for a in artifacts],
        "test_logs": [artifact_out(a) for a in artifacts if a.kind == "test_log"],
        "comments": [{"id": str(c.id), "type": c.type, "author": c.author,
                      "body": st.text_out(c.body, redacted=redacted), "source_task_id": st.sid(c.source_task_id),
                      "source_attempt_id": st.sid(c.source_attempt_id), "created_at": st.iso(c.created_at)}
                     for c in comments.order_by("created_at", "id")],
        "summary": {
            "tasks": len(tasks), "attempts": len(attempts),
            "policy_retries": sum(1 for t in tasks if t.retry_of_id),
            "infrastructure_retries": sum(1 for a in attempts if a.number > 1),
            "failed_attempts": [str(a.id) for a in attempts if a.state == "failed"],
            "succeeded_attempts": [str(a.id) for a in attempts if a.state == "succeeded"],
        },
    })
    return st.record_finish(record)


def session_context(session: Session, turns: list[Turn]) -> dict:
    """For the session record: the runs its turns worked for (registered in ExecutionsConfig.ready)."""
    ids = {t.attempt_id for t in turns if t.attempt_id}
    attempts = (Attempt.objects.filter(Q(session=session) | Q(id__in=ids))
                .select_related("task__node__run__issue").order_by("created_at", "id"))
    rows = []
    for a in attempts:
        task, run = a.task, a.task.node.run
        rows.append({
            "attempt": str(a.id), "number": a.number,
            "made_by": "infrastructure_retry" if a.number > 1 else "first_attempt", "state": a.state,
            "task": str(task.id), "task_ordinal": task.ordinal,
            "task_made_by": "policy_retry" if task.retry_of_id else "first_task", "node": task.node.key,
            "run": str(run.id), "run_state": run.state, "issue": str(run.issue_id), "issue_title": run.issue.title,
            "acceptance_pending": acceptance_out(run.issue)["pending"],
        })
    return {"attempts": rows}


# ---------------------------------------------------------------- Markdown
def record_markdown(record: dict) -> str:
    if record["kind"] == "session":
        return st.session_markdown(record)
    issue, run = record["issue"], record["run"]
    lines = st.md_header(record, f"Troubleshooting record — run {run['id']}")
    acceptance = issue["acceptance"]
    lines += ["## Issue", "",
              f"- Issue `{issue['id']}`: {st.md_cell(issue['title'])} ({issue['status']},"
              f" completion policy {issue['completion_policy']})",
              f"- Acceptance: **{'pending' if acceptance['pending'] else 'not pending'}**"
              f" ({acceptance['state'].replace('_', ' ')})", ""]
    if issue["acceptance_criteria"]:
        lines += ["Acceptance criteria:", "", *st.md_block(issue["acceptance_criteria"])]
    revision = run["workflow_revision"]
    lines += ["## Run", "",
              f"- Run `{run['id']}` · mode {run['mode']} · state **{run['state']}** · trigger {run['trigger']}",
              "- Workflow revision: " + (f"{revision['workflow']} r{revision['number']} (`{revision['id']}`)"
                                         if revision else "–"),
              f"- Rerun of: {st.md_cell(run['rerun_of'])} · reruns: {st.md_cell(', '.join(run['reruns']))}",
              f"- Wait: {st.md_cell(run['wait_reason'])} {st.md_cell(run['wait_detail'] or '')}",
              f"- Failure: {st.md_cell(run['failure_code'])} {st.md_cell(run['failure_message'])}",
              f"- Created {st.md_cell(run['created_at'])} · started {st.md_cell(run['started_at'])}"
              f" · completed {st.md_cell(run['completed_at'])}", "",
              "Last event cursors:", ""]
    lines += [f"- `{name}`: {cursor}" for name, cursor in record["event_cursors"].items()] + [""]
    summary = record["summary"]
    lines += [f"## Attempts ({summary['attempts']} in {summary['tasks']} tasks; policy retries:"
              f" {summary['policy_retries']}, infrastructure retries: {summary['infrastructure_retries']})", ""]
    rows, details = [], []
    for node in record["nodes"]:
        for task in node["tasks"]:
            for a in task["attempts"]:
                turn = a["turn"] or {}
                rows.append([node["key"], f"task {task['ordinal']} ({task['made_by'].replace('_', ' ')})",
                             f"attempt {a['number']} ({a['made_by'].replace('_', ' ')})", a["state"],
                             (a["outcome"] or {}).get("intent"), a["failure_code"], a["session_id"],
                             a["backend_session_id"], (a["connection"] or {}).get("name"), a["host"],
                             " / ".join(x for x in (a["backend"], a["provider"], a["model"]) if x),
                             turn.get("status"), turn.get("interrupted_reason"), a["started_at"], a["ended_at"]])
                details += _attempt_markdown(node, task, a)
        if not node["tasks"]:
            rows.append([node["key"], "no task", "", node["state"], "", node["failure_code"]] + [""] * 9)
    lines += st.md_table(["node", "task", "attempt", "state", "outcome", "failure", "session", "backend session",
                          "connection", "host", "backend / provider / model", "turn", "reason", "started", "ended"],
                         rows)
    lines += ["## Nodes", "", *st.md_table(
        ["node", "type", "state", "iteration", "depends on", "wait", "failure"],
        [[n["key"], n["type"], n["state"], n["iteration"], ", ".join(n["depends_on"] or []), n["wait_reason"],
          " ".join(x for x in (n["failure_code"], n["failure_message"]) if x)] for n in record["nodes"]])]
    lines += ["## Attempt details", "", *details]
    for title, items in (("Artifacts", record["artifacts"]), ("Test logs", record["test_logs"])):
        lines += [f"## {title}", ""]
        lines += st.md_table(["name", "kind", "size", "sha256", "attempt", "link"],
                             [[a["name"], a["kind"], a["size"], a["sha256"], a["attempt_id"],
                               f"[content]({a['link']})"] for a in items]) if items else ["None.", ""]
    if record["comments"]:
        lines += ["## Comments from this run's tasks", "", *st.md_table(
            ["type", "author", "attempt", "at", "body"],
            [[c["type"], c["author"], c["source_attempt_id"], c["created_at"], c["body"]["text"]]
             for c in record["comments"]])]
    return "\n".join(lines).rstrip() + "\n"


def _attempt_markdown(node: dict, task: dict, a: dict) -> list[str]:
    session = a["session"] or {}
    connection = a["connection"] or {}
    lines = [f"### {node['key']} · task {task['ordinal']} · attempt {a['number']} — {a['state']}", "",
             f"- Attempt `{a['id']}` ({a['made_by'].replace('_', ' ')}"
             + (", fresh session" if a["fresh_session"] else "") + f") of task `{task['id']}`"
             + (f" (policy retry of `{task['retry_of']}`)" if task["retry_of"] else ""),
             f"- Portal session `{st.md_cell(a['session_id'])}`"
             f" · backend session `{st.md_cell(a['backend_session_id'])}` · last event cursor {st.md_cell(session.get('event_cursor'))}",
             f"- Connection {st.md_cell(connection.get('name'))} (`{st.md_cell(connection.get('id'))}`) on host"
             f" {st.md_cell(a['host'])} · backend {st.md_cell(a['backend'])} · provider {st.md_cell(a['provider'])}"
             f" · model {st.md_cell(a['model'])} · cwd `{st.md_cell(a['cwd'])}`",
             f"- Outcome: {st.md_cell(a['outcome'])} · failure: {st.md_cell(a['failure_code'])}"
             f" {st.md_cell(a['failure_message'])}",
             f"- Created {st.md_cell(a['created_at'])} · started {st.md_cell(a['started_at'])}"
             f" · ended {st.md_cell(a['ended_at'])}"]
    for turn in ([a["turn"]] if a["turn"] else []) + a["other_turns"]:
        lines += [f"- Turn `{turn['id']}` (seq {turn['seq']}, {turn['trigger']}): {turn['status']}"
                  + (f" ({turn['interrupted_reason']})" if turn["interrupted_reason"] else "")
                  + f" · stop state {turn['stop_state']}"]
        lines += st.md_wake_error("Wake error", turn["wake_error"])
        lines += st.md_text("Prompt", turn["prompt"]) + st.md_text("Final reply", turn["final_reply"])
    if a["artifacts"]:
        lines.append("- Artifacts: " + ", ".join(f"[{x['name']}]({x['link']}) ({x['kind']})" for x in a["artifacts"]))
    return lines + [""]


# ---------------------------------------------------------------- admin download
def admin_download_view(model_admin, request, object_id, fmt: str):
    """The run page's "Troubleshooting record" links: always redacted, details withheld (a shared export)."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    run = model_admin.get_object(request, object_id)
    if run is None:
        raise Http404("no such run")
    record = run_record(run, redacted=True, include_details=False)
    return st.export_response(user=request.user, record=record, target=f"run:{run.pk}", filename=f"run-{run.pk}",
                              fmt=fmt, markdown=record_markdown, client="admin", attachment=True)
