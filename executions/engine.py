"""The run engine (SPEC §6): dispatch ready nodes → tasks → attempts → turns; converge as turns end.

Driven by ``run_tick`` (a Celery task): it is idempotent and takes the run's row lock, so running it
twice, or on two workers, or again after a worker died mid-way, changes nothing more than once.
Turns tell the engine about themselves through sessions_app.listeners.

Implemented modes: ``direct`` and ``declared`` (agent nodes; approval, signal, timer and subrun
nodes wait).  Repetition: infrastructure failures make a new attempt (``infra_retries``), agent
failures a new task when the node's retry policy allows (``retry_of``).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from chorus_site.audit import actor_name, audit_record
from chorus_site.errors import ApplicationError
from chorus_site.events import event_append
from chorus_site.scheduling import enqueue_on_commit
from sessions_app import actions as session_actions
from sessions_app import selectors as session_selectors
from sessions_app import services as session_services
from sessions_app.models import Connection, Session, Turn

from . import services, states
from .prompts import fresh_context, node_prompt
from .models import AgentTask, Approval, Attempt, Issue, Run, RunNode, WorkflowRevision

log = logging.getLogger(__name__)

DEFAULT_POLICY = {"infra_retries": 2, "fresh_fallback": False, "fallback_backends": []}
ACTIVE_TURN = {"pending", "running", "requires_action"}
# Turn endings that say the machine failed, not the agent (§6.3).
INFRA_REASONS = {"offline", "shutdown", "invalid_path"}
INFRA_WAKE_KINDS = {"spawn_failed", "auth"}


# ---------------------------------------------------------------- start
def run_start(*, issue_id, mode: str, input: dict | None = None, workflow_revision_id=None, target: dict | None = None,
              policy: dict | None = None, actor=None, rerun_of=None, trigger: str = "manual",
              client: str = "api", idempotency_key: str | None = None, parent_node=None,
              reason: str | None = None) -> Run:
    if mode not in states.RUN_MODES:
        raise ApplicationError("bad_request", f"unknown mode {mode!r}", {"allowed": states.RUN_MODES})
    if mode == "subrun" and parent_node is None:
        raise ApplicationError("bad_request", "subrun runs are started by a parent's subrun node")
    issue = Issue.objects.filter(pk=issue_id).first()
    if issue is None:
        raise ApplicationError("bad_request", "unknown issue", {"issue": str(issue_id)})
    if issue.status == "done":
        raise ApplicationError("invalid_transition", "the issue is done; reopen it first (its Reopen button, or "
                               f"POST /api/v1/issues/{issue.pk}/reopen)", {"status": issue.status})
    if issue.status in states.ISSUE_TERMINAL:
        raise ApplicationError("invalid_transition", f"the issue is {issue.status}, which is final: "
                               "open a new issue for further work", {"status": issue.status})
    input = dict(input or {})
    revision = None
    if mode in {"declared", "subrun"}:
        revision = (WorkflowRevision.objects.filter(pk=workflow_revision_id).first()
                    if workflow_revision_id and _is_uuid(workflow_revision_id) else None)
        if revision is None:
            raise ApplicationError("bad_request", f"a {mode} run needs an existing workflow_revision")
    elif not str(input.get("prompt", "")).strip():
        raise ApplicationError("bad_request", f"a {mode} run needs input.prompt")
    target = _validate_target(target or {})
    policy = {**DEFAULT_POLICY, **(policy or {})}
    if not isinstance(policy["infra_retries"], int) or not 0 <= policy["infra_retries"] <= 10:
        raise ApplicationError("bad_request", "policy.infra_retries must be an integer from 0 to 10")
    with transaction.atomic():
        run = Run.objects.create(issue=issue, mode=mode, workflow_revision=revision, input=input, target=target,
                                 policy=policy, rerun_of=rerun_of, trigger=trigger, parent_node=parent_node,
                                 parent_run_id=parent_node.run_id if parent_node else None,
                                 idempotency_key=idempotency_key or "",
                                 created_by=actor if getattr(actor, "pk", None) else None)
        first_key = "lead" if mode == "adaptive" else "main"
        specs = revision.spec["nodes"] if revision else [{"key": first_key, "type": "agent", "depends_on": [],
                                                          "prompt": input["prompt"], "retry": {"max_task_retries": 0},
                                                          "leader": mode == "adaptive"}]
        for spec in specs:
            RunNode.objects.create(run=run, key=spec["key"], type=spec.get("type", "agent"),
                                   depends_on=spec.get("depends_on", []), config=spec)
        event_append(stream=run.stream, kind="run.created", actor=actor_name(actor),
                     data={"id": str(run.pk), "mode": mode, "issue": str(issue.pk),
                           "rerun_of": str(rerun_of.pk) if rerun_of else None})
        run = services.run_set_state(run_id=run.pk, state="running", actor=actor)
        _issue_to_in_progress(issue, actor)
        audit_record(actor=actor, action="run.start", target=f"run:{run.pk}", outcome="running", client=client,
                     reason=reason, idempotency_key=idempotency_key)
        schedule_tick(run.pk)
    return run


def _validate_target(target: dict) -> dict:
    if not isinstance(target, dict):
        raise ApplicationError("bad_request", "target must be an object {connection?, cwd?, backend?}")
    if target.get("connection"):
        connection = Connection.objects.filter(pk=target["connection"]).first() if _is_uuid(target["connection"]) \
            else None
        if connection is None:
            raise ApplicationError("bad_request", "target.connection is not a known connection")
        if target.get("cwd") and not session_services.cwd_allowed(connection, target["cwd"]):
            raise ApplicationError("bad_request", "target.cwd is not inside the connection's directories")
    return {k: str(v) for k, v in target.items() if k in {"connection", "cwd", "backend"} and v}


def _is_uuid(value) -> bool:
    import uuid

    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def _issue_to_in_progress(issue: Issue, actor) -> None:
    path = {"backlog": ["todo", "in_progress"], "todo": ["in_progress"], "in_review": ["in_progress"]}
    for status in path.get(issue.status, []):
        services.issue_set_status(issue_id=issue.pk, status=status, actor=actor)


def schedule_tick(run_id) -> None:
    """Wake a tick after commit; a lost wake-up is found again by ``recovery.runs_needing_a_tick``."""
    from .tasks import run_tick

    enqueue_on_commit(run_tick, args=[str(run_id)])


# ---------------------------------------------------------------- the tick
def run_tick_apply(*, run_id) -> str:
    """Advance one run as far as it can go now; returns its state."""
    with transaction.atomic():
        services.run_lock(run_id)  # first, its parents' before it (lock order: chorus_site/transitions.py)
        run = Run.objects.filter(pk=run_id).first()
        if run is None or run.state in states.RUN_TERMINAL:
            return run.state if run else "missing"
        _converge_attempts(run)
        nodes = list(RunNode.objects.filter(run=run).order_by("id"))
        if run.state == "cancelling":
            return _finish_cancel(run, nodes)
        waits = []
        # A node finishing in this tick (a timer due, a dependency done) readies its dependents at once.
        # Paused: the results of running attempts are recorded (above), nothing else moves (§4.7).
        for _ in range(len(nodes) + 1 if run.state != "paused" else 0):
            before = [(n.pk, n.state) for n in nodes]
            _promote_nodes(nodes)
            # Running nodes too: a failed attempt (infra retry) or task (policy retry) needs a successor.
            _block_nodes_of_cancelled_tasks(nodes)
            waits = [_dispatch_node(run, node) for node in nodes
                     if node.state in {"ready", "running", "waiting"} and node.type == "agent"]
            _wait_on_other_nodes(run, nodes)
            waits = [w for w in waits if w]
            nodes = list(RunNode.objects.filter(run=run).order_by("id"))
            if [(n.pk, n.state) for n in nodes] == before:
                break
        return _settle_run(run, waits)


def _promote_nodes(nodes: list[RunNode]) -> None:
    by_key = {n.key: n for n in nodes}
    for node in nodes:
        if node.state != "pending":
            continue
        deps = [by_key[d] for d in node.depends_on if d in by_key]
        if any(d.state in {"failed", "cancelled", "skipped"} and not _tolerated(d) for d in deps):
            node.state = services.node_set_state(node_id=node.pk, state="skipped").state
        elif all(d.state in {"succeeded", "skipped"} or (d.state == "failed" and _tolerated(d)) for d in deps):
            node.state = services.node_set_state(node_id=node.pk, state="ready").state


def _tolerated(node: RunNode) -> bool:
    return node.state == "failed" and bool(node.config.get("continue_on_failure"))


def _wait_on_other_nodes(run: Run, nodes: list[RunNode]) -> None:
    """Approval, signal and timer nodes wait for their cause; subrun nodes are not executed yet."""
    now = timezone.now()
    for node in nodes:
        if node.type == "agent" or node.state not in {"ready", "waiting"}:
            continue
        if node.state == "ready":
            reason, detail = _node_wait(run, node, now)
            services.node_set_state(node_id=node.pk, state="waiting", wait_reason=reason, wait_detail=detail)
            node.state, node.wait_reason, node.wait_detail = "waiting", reason, detail
        elif node.type == "timer" and node.wait_detail.get("until") and node.wait_detail["until"] <= now.isoformat():
            services.node_set_state(node_id=node.pk, state="succeeded")
            node.state = "succeeded"


def _node_wait(run: Run, node: RunNode, now) -> tuple[str, dict]:
    if node.type == "approval":
        from django.contrib.auth.models import Group

        group = Group.objects.filter(name=node.config.get("approver_group") or "").first()
        approval = Approval.objects.create(node=node, approver_group=group,
                                           prompt=node.config.get("prompt") or f"Approve “{node.key}”?")
        event_append(stream=run.stream, kind="approval.created", data={"id": str(approval.pk), "node": str(node.pk)})
        return "approval", {"approval": str(approval.pk), "unblock": "decide the approval (inbox or API)"}
    if node.type == "signal":
        name = node.config.get("signal") or node.key
        return "signal", {"signal": name, "unblock": f"POST /api/v1/runs/{run.pk}/signals/{name}"}
    if node.type == "timer":
        until = now + timedelta(seconds=float(node.config.get("seconds", 60)))
        return "timer", {"until": until.isoformat(), "unblock": "it continues by itself at that time"}
    try:
        child = run_start(issue_id=run.issue_id, mode="subrun", workflow_revision_id=node.config.get("revision"),
                          input=node.config.get("input") or run.input, target=run.target, policy=run.policy,
                          trigger="subrun", parent_node=node)
    except ApplicationError as refused:
        return "blocked", {"error": refused.message, "unblock": "fix the subrun's workflow revision and rerun"}
    return "dependency", {"run": str(child.pk), "unblock": "it continues when the child run finishes"}


# ---------------------------------------------------------------- dispatch
def _dispatch_node(run: Run, node: RunNode) -> dict | None:
    """Make sure a ready agent node has a task with an attempt on a turn; a wait reason if it cannot."""
    task = node.tasks.exclude(status__in=states.TASK_TERMINAL).order_by("-ordinal").first()
    if task is None:
        latest = node.tasks.order_by("-ordinal").first()
        if node.state == "waiting" or (latest is not None and latest.status == "cancelled"):
            return None  # an operator cancelled it: only a task retry (or a rerun) goes on
        task = services.task_create(node_id=node.pk, retry_of_id=latest.pk if latest else None,
                                    leader=bool(node.config.get("leader")))
    attempt = task.attempts.exclude(state__in=states.ATTEMPT_TERMINAL).first()
    if attempt is not None:
        return None
    retry_after = (task.result or {}).get("retry_after")
    if retry_after and retry_after > timezone.now().isoformat():
        return {"reason": "retry_backoff", "detail": {"until": retry_after, "task": str(task.pk),
                                                       "unblock": "the next attempt starts by itself then"}}
    connection, wait = _choose_connection(run, node, task)
    if connection is None:
        return wait
    attempt = Attempt.objects.create(task=task, number=task.attempts.count() + 1, connection=connection,
                                     backend=connection.backend)
    event_append(stream=run.stream, kind="attempt.created",
                 data={"id": str(attempt.pk), "task": str(task.pk), "number": attempt.number,
                       "connection": str(connection.pk)})
    session = _task_session(run, task, connection)
    services.attempt_set_state(attempt_id=attempt.pk, state="assigned", session=session, cwd=session.cwd,
                               provider_session_id=session.backend_session_id or "")
    prompt = node_prompt(run, node)
    if (task.result or {}).get("fallback") or task.retry_of_id:
        # A fresh session, or a retry after a failure or a block: what people wrote since matters.
        prompt = fresh_context(run) + "\n\n" + prompt
    answer = session_actions.turn_enqueue(session_id=session.pk, trigger="task_assigned", prompt=prompt,
                                          attempt_id=attempt.pk)
    services.attempt_set_state(attempt_id=attempt.pk, state="preparing", turn_id=answer["turn"])
    AgentTask.objects.filter(pk=task.pk).update(current_attempt=attempt, session=session)
    if task.status == "queued":
        services.task_set_status(task_id=task.pk, status="dispatched")
    if node.state in {"ready", "waiting"}:
        services.node_set_state(node_id=node.pk, state="running", wait_reason="", wait_detail={})
    return None


def _block_nodes_of_cancelled_tasks(nodes: list[RunNode]) -> None:
    for node in nodes:
        if node.type != "agent" or node.state not in {"ready", "running"}:
            continue
        if node.tasks.exclude(status__in=states.TASK_TERMINAL).exists():
            continue
        latest = node.tasks.order_by("-ordinal").first()
        if latest is not None and latest.status == "cancelled":
            services.node_set_state(node_id=node.pk, state="waiting", wait_reason="blocked",
                                    wait_detail={"task": str(latest.pk),
                                                 "unblock": "retry the task, or cancel the run"})
            node.state = "waiting"


def _choose_connection(run: Run, node: RunNode, task: AgentTask):
    """The run's target, else a live connection of the node's backend with capacity (§6.2)."""
    bound = task.attempts.exclude(connection=None).order_by("-number").first()
    wanted = run.target.get("connection") or (bound.connection_id if bound else None)
    backend = node.config.get("backend") or run.target.get("backend")
    backends = [backend] if backend else []
    if (task.result or {}).get("fallback"):
        # Fresh fallback: any live connection of a fallback backend, never the one that failed.
        wanted, backends = None, list(run.policy.get("fallback_backends") or [])
    candidates = Connection.objects.filter(pk=wanted) if wanted else Connection.objects.exclude(status="draining")
    if (task.result or {}).get("fallback") and bound:
        candidates = candidates.exclude(pk=bound.connection_id)
    if backends and not wanted:
        candidates = candidates.filter(backend__in=backends)
    live = [c for c in candidates if session_selectors.connection_is_live(c)]
    if not live:
        if wanted:
            return None, {"reason": "host_offline", "detail": {"connection": str(wanted),
                                                                "unblock": "restore the connection's daemon"}}
        return None, {"reason": "no_worker", "detail": {"backend": ", ".join(backends) or "any",
                                                         "unblock": "start a daemon for this backend"}}
    for connection in live:
        # Turns running on the connection (their own, not their session's: a session may have moved).
        busy = Turn.objects.filter(connection=connection, status__in=["running", "requires_action"]).count()
        if busy < connection.max_concurrency:
            return connection, None
    return None, {"reason": "capacity", "detail": {"connection": str(live[0].pk),
                                                    "unblock": "it continues when a running turn ends"}}


def _task_session(run: Run, task: AgentTask, connection: Connection) -> Session:
    """Each task has its own session (idea key ``task:<id>``); a later attempt on the same
    connection resumes it, on another connection it moves (§6.2)."""
    fresh = bool((task.result or {}).get("fallback"))
    idea_key = f"task:{task.pk}:fresh" if fresh else f"task:{task.pk}"
    session = Session.objects.filter(idea_key=idea_key, status="active").first()
    cwd = (run.target.get("cwd") if not fresh else None) or connection.cwds[0]
    if session is None:
        return session_services.session_create(connection=connection, cwd=cwd, idea_key=idea_key,
                                               title=f"{run.issue.title} · {task.node.key}")
    if session.connection_id != connection.pk:
        # The agent CLI's session stays on the machine it ran on: the moved session starts a fresh one.
        Session.objects.filter(pk=session.pk).update(connection=connection, cwd=cwd, backend=connection.backend,
                                                     backend_session_id=None)
        event_append(stream=session.stream, kind="session.moved",
                     data={"id": str(session.pk), "to": {"connection": str(connection.pk), "cwd": cwd}})
        session.refresh_from_db()
    return session


def _dependency_done(ref: str) -> bool:
    if not _is_uuid(ref):
        return False
    if Issue.objects.filter(pk=ref, status="done").exists():
        return True
    return Run.objects.filter(pk=ref, state__in={"succeeded", "partial_succeeded"}).exists()


def _continue_if_dependency_cleared(run: Run, attempt: Attempt) -> None:
    """A waiting attempt goes on in the same session once the work it waits for is done."""
    ref = (attempt.outcome or {}).get("waiting_on") or (attempt.outcome or {}).get("ref")
    if not ref or not _dependency_done(ref):
        return
    node = attempt.task.node
    answer = session_actions.turn_enqueue(
        session_id=attempt.session_id, trigger="task_assigned", attempt_id=attempt.pk,
        prompt=f"The work you were waiting for ({ref}) is done. Continue the task where you left it.")
    services.attempt_set_state(attempt_id=attempt.pk, state="running", turn_id=answer["turn"], outcome=None)
    services.task_set_status(task_id=attempt.task_id, status="running")
    services.node_set_state(node_id=node.pk, state="running", wait_reason="", wait_detail={})


# ---------------------------------------------------------------- converge
def _converge_attempts(run: Run) -> None:
    attempts = (Attempt.objects.filter(task__node__run=run).exclude(state__in=states.ATTEMPT_TERMINAL)
                .select_related("turn", "task__node"))
    for attempt in attempts:
        # The attempt's latest turn: answering a question or resuming adds turns to the same attempt.
        turn = Turn.objects.filter(attempt_id=attempt.pk).order_by("-created_at").first() or attempt.turn
        if turn is None:
            continue
        if attempt.turn_id != turn.pk:
            Attempt.objects.filter(pk=attempt.pk).update(turn=turn)
            attempt.turn = turn
        if attempt.state == "waiting" and (attempt.outcome or {}).get("intent") == "waiting":
            _continue_if_dependency_cleared(run, attempt)
            continue
        node = attempt.task.node
        if turn.status == "requires_action" and attempt.state in {"preparing", "running"}:
            if attempt.state == "preparing":
                services.attempt_set_state(attempt_id=attempt.pk, state="running")
            services.attempt_set_state(attempt_id=attempt.pk, state="waiting")
            kind = (turn.requires_action or {}).get("kind")
            reason = "tool_result" if kind == "external_execution" else "approval"
            if node.state == "running":
                services.node_set_state(node_id=node.pk, state="waiting", wait_reason=reason,
                                        wait_detail={"turn": str(turn.pk), "unblock": "answer the turn's question "
                                                     "(turn page or POST /turns/{id}/actions)"})
            continue
        if attempt.state == "waiting" and turn.status in {"pending", "running"}:
            services.attempt_set_state(attempt_id=attempt.pk, state="running")
            if node.state == "waiting":
                services.node_set_state(node_id=node.pk, state="running", wait_reason="", wait_detail={})
            continue
        if attempt.state == "waiting" and turn.status in {"ended", "interrupted", "merged"}:
            services.attempt_set_state(attempt_id=attempt.pk, state="running")
            attempt.state = "running"
            if node.state == "waiting":
                services.node_set_state(node_id=node.pk, state="running", wait_reason="", wait_detail={})
        if turn.status in {"running", "requires_action"} and attempt.state in {"preparing", "assigned"}:
            services.attempt_set_state(attempt_id=attempt.pk, state="running", heartbeat_at=timezone.now())
            if attempt.task.status == "dispatched":
                services.task_set_status(task_id=attempt.task_id, status="running")
        elif turn.status in {"ended", "interrupted", "merged"}:
            # Decided under the turn's lock (run rows → session → turn): a reopen of a turn settled
            # offline (its daemon still holds it) either committed first — it runs again — or waits
            # and then sees this attempt ended, and refuses (turn_reopen_check).
            turn = session_services.turn_lock(turn.pk)
            if turn is not None and turn.status in {"ended", "interrupted", "merged"}:
                _attempt_finished(run, attempt, turn)


def turn_reopen_check(turn: Turn) -> str | None:
    """Why a turn settled offline may not run again for its attempt (sessions_app.listeners.on_turn_reopen).

    Once the engine has ended the attempt (failed on the settle: a new attempt follows after its
    backoff, or the node failed; cancelled), the agent still working would do the work twice, or
    work nobody waits for: its process is stopped instead.  Called under the turn's lock.
    """
    if not turn.attempt_id:
        return None
    attempt = Attempt.objects.filter(pk=turn.attempt_id).values("number", "state").first()
    if attempt is None:
        return None
    if attempt["state"] in states.ATTEMPT_TERMINAL:
        return f"attempt {attempt['number']} of its task already ended {attempt['state']}"
    if Turn.objects.filter(attempt_id=turn.attempt_id, created_at__gt=turn.created_at).exists():
        return f"attempt {attempt['number']} of its task went on in a later turn"
    return None


def _attempt_finished(run: Run, attempt: Attempt, turn: Turn) -> None:
    _attempt_keep_provider_session_id(attempt, turn)
    outcome = {k: v for k, v in (attempt.outcome or {}).items() if v} or turn_outcome(turn)
    task, node = attempt.task, attempt.task.node
    if attempt.state == "preparing":  # the turn ran and ended between two ticks
        services.attempt_set_state(attempt_id=attempt.pk, state="running")
    if task.status == "dispatched":
        task = services.task_set_status(task_id=task.pk, status="running")
    if attempt.state == "cancel_requested" or (turn.status == "interrupted" and turn.interrupted_reason == "user"):
        if attempt.state != "cancel_requested":
            services.attempt_set_state(attempt_id=attempt.pk, state="cancel_requested")
        services.attempt_set_state(attempt_id=attempt.pk, state="cancelled", usage=turn.usage or {})
        task.refresh_from_db()
        if run.state != "cancelling" and task.status not in states.TASK_TERMINAL:
            # An operator stopped this turn directly: the task failed; its node may retry.
            services.task_set_status(task_id=task.pk, status="failed", error="stopped by an operator")
            _node_failed_or_retry(node, task, "stopped by an operator")
        return
    if turn.status == "ended" and outcome.get("intent") == "waiting" and outcome.get("waiting_on", outcome.get("ref")):
        # It waits for another piece of work; it continues by itself when that is done (§6.5).
        ref = outcome.get("waiting_on") or outcome.get("ref")
        services.attempt_set_state(attempt_id=attempt.pk, state="waiting", outcome=outcome)
        services.task_set_status(task_id=task.pk, status="waiting", wait_reason="dependency")
        services.node_set_state(node_id=node.pk, state="waiting", wait_reason="dependency",
                                wait_detail={"waiting_on": ref, "unblock": "it continues when that work is done"})
        return
    if turn.status == "ended" and outcome.get("intent") == "blocked":
        # The agent cannot go on; its partial work is kept.  No automatic retry: a person decides.
        services.attempt_set_state(attempt_id=attempt.pk, state="failed", outcome=outcome, failure_code="blocked",
                                   failure_message=outcome.get("summary") or "the agent reported it is blocked")
        services.task_set_status(task_id=task.pk, status="failed", error="blocked")
        services.node_set_state(node_id=node.pk, state="waiting", wait_reason="blocked",
                                wait_detail={"task": str(task.pk), "summary": outcome.get("summary") or "",
                                             "unblock": "comment on the issue with what it needs, then retry the task"})
        return
    if turn.status == "ended" and outcome.get("intent") == "succeeded":
        services.attempt_set_state(attempt_id=attempt.pk, state="succeeded", outcome=outcome, usage=turn.usage or {})
        services.task_set_status(task_id=task.pk, status="completed", result=outcome)
        services.node_set_state(node_id=node.pk, state="succeeded")
        return
    infra = turn.status == "interrupted" and (turn.interrupted_reason in INFRA_REASONS or (
        (turn.wake_error or {}).get("kind") in INFRA_WAKE_KINDS))
    code, message = _failure_of(turn, outcome, infra)
    services.attempt_set_state(attempt_id=attempt.pk, state="failed", outcome=outcome or None, failure_code=code,
                               failure_message=message, usage=turn.usage or {})
    if infra and attempt.number <= run.policy.get("infra_retries", 2):
        # Attempt n+1 of the same task, after a backoff (2 s, 4 s, 8 s … at most a minute).
        until = timezone.now() + timedelta(seconds=min(60, 2 ** attempt.number))
        AgentTask.objects.filter(pk=task.pk).update(result={**(task.result or {}), "retry_after": until.isoformat()})
        return
    if infra and run.policy.get("fresh_fallback") and not (task.result or {}).get("fallback"):
        # §6.4: the original connection's retries are spent; the next attempt starts fresh elsewhere.
        AgentTask.objects.filter(pk=task.pk).update(result={**(task.result or {}), "fallback": True})
        event_append(stream=run.stream, kind="task.fallback",
                     data={"id": str(task.pk), "after_attempt": attempt.number,
                           "backends": run.policy.get("fallback_backends") or []})
        return
    services.task_set_status(task_id=task.pk, status="failed", error=message)
    _node_failed_or_retry(node, task, message)


def _attempt_keep_provider_session_id(attempt: Attempt, turn: Turn) -> None:
    """The agent's own session id, learnt while the turn ran (unknown when a fresh attempt was
    dispatched), is the attempt's too: its page and record name it, not "-"."""
    known = Session.objects.filter(pk=turn.session_id).values_list("backend_session_id", flat=True).first()
    if known and known != attempt.provider_session_id:
        Attempt.objects.filter(pk=attempt.pk).update(provider_session_id=known)
        attempt.provider_session_id = known


def _failure_of(turn: Turn, outcome: dict, infra: bool) -> tuple[str, str]:
    if infra:
        reason = turn.interrupted_reason or (turn.wake_error or {}).get("kind")
        return "infrastructure", f"the turn ended {turn.status_label}: {reason}"
    if outcome.get("intent") in {"failed", "blocked", "waiting"}:
        return f"outcome_{outcome['intent']}", outcome.get("summary") or f"the agent reported {outcome['intent']}"
    if turn.status == "interrupted":
        return "agent_crashed", (turn.wake_error or {}).get("summary") or turn.status_label
    return "no_outcome", "the agent ended without reporting an outcome (prose is not success)"


def _node_failed_or_retry(node: RunNode, task: AgentTask, message: str) -> None:
    allowed = int((node.config.get("retry") or {}).get("max_task_retries", 0))
    if node.tasks.count() <= allowed:
        return  # the next tick makes a new task with retry_of (a policy retry)
    services.node_set_state(node_id=node.pk, state="failed", failure_code="agent_failed", failure_message=message)


def turn_outcome(turn: Turn) -> dict:
    """The agent's explicit outcome, from its reported output (the last one wins)."""
    from chorus_site.models import Event

    found = {}
    for event in Event.objects.filter(stream=turn.stream, kind="turn.output", data__id=str(turn.pk),
                                      data__type="outcome").order_by("id"):
        agent = event.data.get("data") or {}  # the agent's own data, nested (sessions_app.bridge)
        found = {k: v for k, v in agent.items() if k in {"intent", "ref", "summary"}}
    return found


# ---------------------------------------------------------------- run state
def _settle_run(run: Run, waits: list[dict]) -> str:
    if run.state == "paused":
        # No progress until an operator resumes, not even completion: resuming converges (§4.7).
        return run.state
    nodes = list(RunNode.objects.filter(run=run))
    if all(n.state in states.NODE_TERMINAL for n in nodes):
        return _complete(run, nodes)
    # Attempts that wait for other work do not keep the run busy.
    idle = not (Attempt.objects.filter(task__node__run=run).exclude(state__in=states.ATTEMPT_TERMINAL)
                .exclude(state="waiting").exists())
    waiting_nodes = [n for n in nodes if n.state == "waiting"]
    if idle and not waits and waiting_nodes:
        waits = [{"reason": waiting_nodes[0].wait_reason, "detail": waiting_nodes[0].wait_detail}]
    if waits and idle:
        wait = waits[0]
        if run.state == "running":
            services.run_set_state(run_id=run.pk, state="waiting", wait_reason=wait["reason"],
                                   wait_detail=wait["detail"])
        elif run.wait_reason != wait["reason"] or run.wait_detail != wait["detail"]:
            # Still waiting, for another reason now: the reason is shown, the state does not change.
            Run.objects.filter(pk=run.pk).update(wait_reason=wait["reason"], wait_detail=wait["detail"])
            event_append(stream=run.stream, kind="run.wait", data={"id": str(run.pk), "wait_reason": wait["reason"]})
        return "waiting"
    if run.state == "waiting":
        services.run_set_state(run_id=run.pk, state="running")
    return "running"


def _complete(run: Run, nodes: list[RunNode]) -> str:
    succeeded = [n for n in nodes if n.state == "succeeded"]
    failed = [n for n in nodes if n.state == "failed"]
    if not failed:
        state = "succeeded"
    elif succeeded and all(_tolerated(n) for n in failed):
        state = "partial_succeeded"
    else:
        state = "failed"
    updates = {}
    if state == "failed":
        updates = {"failure_code": "node_failed",
                   "failure_message": "; ".join(f"{n.key}: {n.failure_message}" for n in failed)[:2000]}
    services.run_set_state(run_id=run.pk, state=state, **updates)
    if run.parent_node_id:
        # A subrun finishes its parent's node with its own result (§6.1).
        parent = RunNode.objects.get(pk=run.parent_node_id)
        if parent.state == "waiting":
            ok = state in {"succeeded", "partial_succeeded"}
            services.node_set_state(node_id=parent.pk, state="succeeded" if ok else "failed",
                                    failure_message="" if ok else f"child run {run.pk} {state}")
            schedule_tick(parent.run_id)
        return state  # the parent run reports to the issue
    issue = Issue.objects.get(pk=run.issue_id)
    if state in {"succeeded", "partial_succeeded"} and issue.status == "in_progress":
        target = "done" if issue.completion_policy == "automatic" and state == "succeeded" else "in_review"
        services.issue_set_status(issue_id=issue.pk, status="in_review")
        if target == "done":
            services.issue_set_status(issue_id=issue.pk, status="done")
    return state


def _finish_cancel(run: Run, nodes: list[RunNode]) -> str:
    active = Attempt.objects.filter(task__node__run=run).exclude(state__in=states.ATTEMPT_TERMINAL)
    if active.exists():
        return run.state
    if Run.objects.filter(parent_run=run).exclude(state__in=states.RUN_TERMINAL).exists():
        return run.state  # its subruns are being cancelled too; the last one to finish ticks this run
    for node in nodes:
        if node.state not in states.NODE_TERMINAL:
            services.node_set_state(node_id=node.pk, state="cancelled")
    for task in AgentTask.objects.filter(node__run=run).exclude(status__in=states.TASK_TERMINAL):
        services.task_set_status(task_id=task.pk, status="cancelled")
    state = services.run_set_state(run_id=run.pk, state="cancelled").state
    if run.parent_run_id:
        schedule_tick(run.parent_run_id)
    return state


def run_add_members(*, run_id, lead_task: AgentTask, nodes: list[dict]) -> dict:
    """Adaptive runs: the lead's agent adds member nodes; the run completes when all have (§6.1)."""
    with transaction.atomic():
        services.run_lock(run_id)
        run = Run.objects.get(pk=run_id)
        if run.mode != "adaptive" or run.state in states.RUN_TERMINAL or run.state == "cancelling":
            raise ApplicationError("invalid_transition", f"members can be added to a live adaptive run only "
                                                         f"(this one is {run.mode}, {run.state})")
        if not nodes or len(nodes) > 20:
            raise ApplicationError("bad_request", "add 1 to 20 members at a time")
        added = []
        for item in nodes:
            key = str(item.get("key") or "").strip()
            if not key or len(key) > 90 or not str(item.get("prompt") or "").strip():
                raise ApplicationError("bad_request", "each member needs a key (≤ 90 characters) and a prompt")
            if RunNode.objects.filter(run=run, key=f"member:{key}").exists():
                raise ApplicationError("conflict", f"member {key!r} exists already", {"key": key})
            node = RunNode.objects.create(run=run, key=f"member:{key}", type="agent", depends_on=[],
                                          config={"prompt": item["prompt"], "member_of": lead_task.node.key,
                                                  "retry": {"max_task_retries": 0}})
            event_append(stream=run.stream, kind="node.added",
                         data={"id": str(node.pk), "key": node.key, "added_by": str(lead_task.pk)})
            added.append(node.key)
        schedule_tick(run.pk)
    return {"added": added}


# ---------------------------------------------------------------- listener
def on_turn_status(turn_id: str, attempt_id: str, status: str) -> None:
    run_id = Attempt.objects.filter(pk=attempt_id).values_list("task__node__run_id", flat=True).first()
    if run_id is not None and status in {"running", "requires_action", "ended", "interrupted", "merged"}:
        schedule_tick(run_id)
