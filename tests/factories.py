"""Plain factory functions for tests (no factory_boy).

Rows are made through the creation services where one exists (``connection_register``,
``session_create``, ``turn_create``, ``issue_create``) so they carry the same events as in
production; the execution graph (run, node, task, attempt, approval) has no creation service yet
and is written with the ORM.

``status=``/``state=`` arguments *arrange* a starting point: they set the field directly, without
a transition and without an event, so a test can then count exactly the events its own action
writes.
"""

from __future__ import annotations

import itertools
import uuid

from django.contrib.auth import get_user_model

from chorus_site.models import Event
from executions import services as execution_services
from executions.models import AgentTask, Approval, Attempt, Issue, Run, RunNode
from sessions_app import services as session_services
from sessions_app.models import Connection, Session, Turn

PASSWORD = "pw-Chorus-123"
DEFAULT_CWD = "/srv/work"

_counter = itertools.count(1)


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_counter)}-{uuid.uuid4().hex[:6]}"


# ---------------------------------------------------------------- users
def make_user(*, username: str | None = None, groups=(), is_staff: bool = True, is_superuser: bool = False,
              is_active: bool = True, password: str = PASSWORD):
    user = get_user_model().objects.create_user(
        username=username or unique("user"), password=password, is_staff=is_staff, is_superuser=is_superuser,
        is_active=is_active,
    )
    if groups:
        user.groups.set(groups)
    return user


# ---------------------------------------------------------------- sessions_app
def make_connection(*, name: str | None = None, backend: str = "scripted", cwds=(DEFAULT_CWD,), host: str = "worker-1",
                    status: str | None = None, actor=None, **kwargs) -> Connection:
    """A registered connection; its one-time plain key is kept on ``.plain_key``."""
    connection, key = session_services.connection_register(
        name=name or unique("conn"), backend=backend, cwds=list(cwds), host=host, actor=actor, **kwargs
    )
    if status is not None:
        Connection.objects.filter(pk=connection.pk).update(status=status)
        connection.status = status
    connection.plain_key = key
    return connection


def make_session(*, connection: Connection | None = None, cwd: str | None = None, idea_key: str | None = None,
                 status: str | None = None, actor=None, **kwargs) -> Session:
    connection = connection or make_connection()
    session = session_services.session_create(
        connection=connection, cwd=cwd or connection.cwds[0], idea_key=idea_key or unique("idea"), actor=actor,
        **kwargs,
    )
    if status is not None:
        Session.objects.filter(pk=session.pk).update(status=status)
        session.status = status
    return session


def make_turn(*, session: Session | None = None, trigger: str = "human_instruction", prompt: str = "do the thing",
              status: str | None = None, actor=None, **fields) -> Turn:
    """A turn created by ``turn_create``; ``status`` and other ``fields`` are then set directly."""
    session = session or make_session()
    turn = session_services.turn_create(session=session, trigger=trigger, prompt=prompt, actor=actor)
    if status is not None:
        fields["status"] = status
    if fields:
        Turn.objects.filter(pk=turn.pk).update(**fields)
        turn.refresh_from_db()
    return turn


# ---------------------------------------------------------------- executions
def make_issue(*, title: str | None = None, status: str | None = None, actor=None, **kwargs) -> Issue:
    fields = {name: kwargs.pop(name) for name in ("status_before_blocked", "assignee", "version") if name in kwargs}
    issue = execution_services.issue_create(title=title or unique("issue"), actor=actor, **kwargs)
    if status is not None:
        fields["status"] = status
    if fields:
        Issue.objects.filter(pk=issue.pk).update(**fields)
        issue.refresh_from_db()
    return issue


def make_run(*, issue: Issue | None = None, mode: str = "direct", state: str = "planned", **fields) -> Run:
    return Run.objects.create(issue=issue or make_issue(), mode=mode, state=state, **fields)


def make_node(*, run: Run | None = None, key: str | None = None, state: str = "pending", type: str = "agent",
              **fields) -> RunNode:
    return RunNode.objects.create(run=run or make_run(), key=key or unique("node"), state=state, type=type, **fields)


def make_task(*, node: RunNode | None = None, status: str = "queued", ordinal: int | None = None,
              **fields) -> AgentTask:
    node = node or make_node()
    if ordinal is None:
        ordinal = node.tasks.count() + 1
    return AgentTask.objects.create(node=node, status=status, ordinal=ordinal, **fields)


def make_attempt(*, task: AgentTask | None = None, state: str = "queued", number: int | None = None,
                 connection: Connection | None = None, **fields) -> Attempt:
    task = task or make_task()
    if number is None:
        number = task.attempts.count() + 1
    attempt = Attempt.objects.create(task=task, state=state, number=number, connection=connection,
                                     backend=connection.backend if connection else "", **fields)
    AgentTask.objects.filter(pk=task.pk).update(current_attempt=attempt)
    return attempt


def make_run_graph(*, issue: Issue | None = None, run_state: str = "running", node_state: str = "running",
                   task_status: str = "running", attempt_state: str = "running",
                   connection: Connection | None = None):
    """A direct run with one node, one task and one attempt: returns (run, node, task, attempt)."""
    run = make_run(issue=issue, state=run_state)
    node = make_node(run=run, key="main", state=node_state)
    task = make_task(node=node, status=task_status)
    attempt = make_attempt(task=task, state=attempt_state, connection=connection)
    return run, node, task, attempt


def make_approval(*, node: RunNode | None = None, status: str = "pending", **fields) -> Approval:
    return Approval.objects.create(node=node, status=status, **fields)


# ---------------------------------------------------------------- events
def events_of(stream: str, *, kind: str | None = None) -> list[Event]:
    """Stored events of a stream, oldest first."""
    events = Event.objects.filter(stream=stream).order_by("id")
    if kind is not None:
        events = events.filter(kind=kind)
    return list(events)


def last_event_id() -> int:
    """The newest event id of all streams (0 when the log is empty): a mark to count new events from."""
    return Event.objects.order_by("-id").values_list("id", flat=True).first() or 0


def events_since(mark: int) -> list[Event]:
    """Every event written after ``mark`` (any stream), oldest first."""
    return list(Event.objects.filter(id__gt=mark).order_by("id"))
