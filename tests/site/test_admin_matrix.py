"""R7 access matrix, admin and streams (issue 8): every admin URL × persona × GET/POST, changelist
actions posted directly, /ws/live/ subscriptions and SSE streams per persona.

Generated, like tests/api/test_access_matrix.py for the API: the admin URLs are read from the
admin site (its own patterns and every registered model admin's ``get_urls()``, the custom action
views of executions/admin_views.py and sessions_app/admin_views.py included) and the changelist
actions from each model admin's actions, so a new admin view or action is covered without editing
this file.  A URL parameter this module cannot fill fails the test instead of being skipped.

Each URL is fetched, then POSTed as the page's own form would be (its fields, when the persona
can open it) or directly (a hand-made body, when it cannot); each action is POSTed to its
changelist with one selected row.  What must hold:
- never a server error;
- nobody signed in is sent to the login page and changes nothing;
- a user without an ops role opens no page of an ops model;
- a viewer and a diagnostics reader change nothing with any POST (the database, sessions aside,
  is the same after it);
- a POST to a page the persona may not open changes nothing (a view checking GET only is caught);
- any change an operator or an ops_admin makes leaves an audit entry naming them;
- nobody below ops_admin obtains a usable credential (task token, connection key, API token)
  from any page, POST answer, WebSocket frame or SSE frame — also with legacy rows stored before
  those were redacted.
"""

from __future__ import annotations

import asyncio
import json
import re
from html.parser import HTMLParser

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib import admin
from django.db import connection as db
from django.test import AsyncClient, Client
from django.urls import URLPattern, URLResolver

from chorus_site.events import event_append
from chorus_site.models import AuditEntry, IdempotencyRecord
from chorus_site.tokens import token_authenticate, token_create
from executions import admin_views as execution_admin_views
from executions.models import AgentTask, Artifact, WorkflowDefinition
from executions.task_tokens import attempt_for_task_token, task_token_for
from sessions_app import actions, bridge
from sessions_app.models import ControlCommand
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)

PERSONAS = ("anonymous", "outsider", "viewer", "diagnostics_reader", "operator", "ops_admin_user")
CHANGES_NOTHING = {"anonymous", "outsider", "viewer", "diagnostics_reader"}
ACTORS = {"operator", "ops_admin_user"}
CREDENTIAL = re.compile(r"\b(?:cht|chk|cho)_[A-Za-z0-9_:\-.]{8,}")
# Signing in and out writes these; nothing else may change behind a refused POST.
# A model admin's stock views; every other named view of a model admin is one of ours (an action page).
STOCK_VIEW = re.compile(r"_(changelist|add|history|delete|change)$|^auth_user_password_change$")
UNWATCHED_TABLES = {"django_session", "chorus_site_portalpresence", "axes_accessattempt", "axes_accesslog", "axes_accessfailurelog"}


def usable(candidate: str) -> bool:
    return (attempt_for_task_token(candidate) is not None or bridge.connection_authenticate(candidate) is not None
            or token_authenticate(candidate) is not None)


def harvested(text: str) -> list[str]:
    return [c for c in CREDENTIAL.findall(text) if usable(c)]


# ---------------------------------------------------------------- the admin's URLs, read from the site
def admin_url_patterns() -> list[tuple[str, str | None, type | None]]:
    """(route, name, model) for every pattern of the admin site; model None for the site's own."""
    out = [(str(p.pattern), p.name, None) for p in admin.site.get_urls() if isinstance(p, URLPattern)]
    for model, model_admin in admin.site._registry.items():
        prefix = f"{model._meta.app_label}/{model._meta.model_name}/"
        for pattern in model_admin.get_urls():
            assert not isinstance(pattern, URLResolver), pattern
            if pattern.name:  # the unnamed "<id>/" only redirects to "<id>/change/"
                out.append((prefix + str(pattern.pattern), pattern.name, model))
    return out


def _values(param: str, model, subject) -> list[str]:
    """The values a URL parameter takes; an unknown parameter fails the test (a new view to cover)."""
    from django.contrib.contenttypes.models import ContentType

    from executions.models import Issue

    if param == "object_id":
        return [str(subject.pk)]
    if param == "id":  # auth's user password page
        return [str(subject.pk)]
    if param == "task_id":
        return [str(AgentTask.objects.filter(node__run=subject).values_list("pk", flat=True).first())]
    if param == "name" and model is not None:  # the run's task actions
        return list(execution_admin_views.TASK_ACTIONS)
    if param == "content_type_id":
        return [str(ContentType.objects.get_for_model(Issue).pk)]
    if param == "app_label":
        return sorted({m._meta.app_label for m in admin.site._registry})
    if param == "url":  # the admin's final catch-all
        return ["no-such-page/"]
    raise AssertionError(f"admin URL parameter {param!r} has no values here: cover the new view")


def admin_urls(world) -> list[tuple[str, str | None, type | None]]:
    """(url, name, model) for every admin pattern, its parameters filled from the world's objects."""
    from executions.models import Issue

    urls = []
    for route, name, model in admin_url_patterns():
        subject = world["subjects"].get(model) or (model.objects.order_by("-pk").first() if model else None)
        if route.startswith("r/"):
            subject = Issue.objects.get(pk=world["ids"]["issue"])
        if subject is None and "object_id" in route:
            continue  # no row of that model (e.g. axes' logs): nothing to open
        params = re.findall(r"<(?:\w+:)?(\w+)>|\(\?P<(\w+)>", route)
        combos = [route]
        for plain, regex in params:
            param = plain or regex
            values = _values(param, model, subject)
            combos = [re.sub(rf"<(?:\w+:)?{param}>|\(\?P<{param}>[^)]*\)", value, c, count=1)
                      for c in combos for value in values]
        for url in combos:
            urls.append(("/admin/" + url.lstrip("^").rstrip("$"), name, model))
    return urls


def changelist_actions() -> list[tuple[type, str]]:
    """(model, action name) for every action of every model admin, before any permission filter."""
    return [(model, name) for model, model_admin in admin.site._registry.items()
            for _func, name, _desc in model_admin._get_base_actions()]


class _PostForm(HTMLParser):
    """The fields of the page's main POST form (the one with most fields; the logout form is not it)."""

    def __init__(self):
        super().__init__()
        self.forms: list[dict] = []
        self.current: dict | None = None
        self.textarea: str | None = None
        self.select: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form" and (attrs.get("method") or "").lower() == "post" and "logout" not in (attrs.get("action") or ""):
            self.current = {}
            self.forms.append(self.current)
        elif tag == "option" and self.current is not None and self.select:
            if attrs.get("value") and (self.select not in self.current or "selected" in attrs):
                self.current[self.select] = attrs["value"]
        elif self.current is None or not attrs.get("name"):
            return
        elif tag == "input" and attrs.get("type") not in {"submit", "button", "file"}:
            if attrs.get("type") in {"checkbox", "radio"} and "checked" not in attrs:
                return
            self.current.setdefault(attrs["name"], attrs.get("value") or "")
        elif tag == "textarea":
            self.textarea = attrs["name"]
            self.current[self.textarea] = ""
        elif tag == "select":
            self.select = attrs["name"]

    def handle_data(self, data):
        if self.textarea and self.current is not None:
            self.current[self.textarea] += data

    def handle_endtag(self, tag):
        if tag == "form":
            self.current = None
        elif tag == "textarea":
            self.textarea = None
        elif tag == "select":
            self.select = None


def form_of(html: str) -> dict:
    parser = _PostForm()
    parser.feed(html)
    forms = sorted(parser.forms, key=len, reverse=True)
    return forms[0] if forms else {}


def direct_body(world) -> dict:
    """What a hand-made POST to an action page sends: every field any of them reads, filled in."""
    ids = world["ids"]
    return {"reason": "matrix", "confirmed": "yes", "post": "yes", "kind": "issue", "decision": "accept",
            "id": str(ids["issue"]), "mode": "direct", "prompt": "do it", "cwd": "/srv/work", "name": "go",
            "context": "more", "spec": json.dumps({"nodes": [{"key": "a", "type": "agent", "prompt": "p"}]}),
            "connection": str(ids["connection"]), "title": "t", "version": "1"}


def fingerprint() -> dict[str, str]:
    """{table: digest of its rows} for every table of the database but the sign-in ones (one query)."""
    tables = sorted(set(db.introspection.table_names()) - UNWATCHED_TABLES)
    sql = " UNION ALL ".join(
        f"SELECT '{t}', md5(coalesce((SELECT string_agg(x, ',' ORDER BY x) FROM (SELECT r::text x FROM \"{t}\" r) s), ''))"
        for t in tables)
    with db.cursor() as cursor:
        cursor.execute(sql)
        return dict(cursor.fetchall())


# ---------------------------------------------------------------- the world
@pytest.fixture
def world(personas, ops_admin_user):
    """Objects of every ops model, credentials stored the way they used to be (legacy rows), and
    an attempt dispatched to a daemon with its task token."""
    connection = factories.make_connection(status="online", cwds=["/srv/work"])
    other = factories.make_connection(status="online", cwds=["/srv/work"])
    session = factories.make_session(connection=connection)
    run, node, task, attempt = factories.make_run_graph(connection=connection)
    answer = actions.turn_enqueue(session_id=session.pk, trigger="task_assigned", prompt="work on it",
                                  attempt_id=attempt.pk)
    waiting = factories.make_turn(session=factories.make_session(connection=other), status="running")
    approval = factories.make_approval(node=node)
    artifact = Artifact.objects.create(issue=run.issue, run=run, kind="report", name="a.md", content="# a",
                                       sha256="0" * 64, size=3)
    workflow = WorkflowDefinition.objects.create(name="wf-admin-matrix")
    event_append(stream=run.stream, kind="run.state", data={"id": str(run.pk), "state": run.state})
    # Rows written before the token went on the wire only and before replays withheld keys.
    ControlCommand.objects.create(connection=connection, action="start_turn", turn_id=answer["turn"],
                                  payload={"env": {"CHORUS_TASK_TOKEN": task_token_for(attempt)}})
    IdempotencyRecord.objects.create(scope="user:0", route="connections.register", key="legacy", request_hash="x",
                                     state="done", response_status=201,
                                     response_body={"id": str(other.pk), "key": other.plain_key})
    tokens = {name: token_create(user=user, name="matrix")[1] for name, user in personas.items()}
    from executions.models import Run
    from sessions_app.models import Turn

    from django.contrib.auth.models import Group

    # Users and groups acted on are the world's own: deleting a persona's role would end the test.
    subjects = {Run: run, AgentTask: task, Turn: Turn.objects.get(pk=answer["turn"]),
                Group: Group.objects.create(name="matrix-group"),
                get_user_model(): factories.make_user(username="matrix-user")}
    return {"ids": {"issue": run.issue_id, "connection": connection.pk, "run": run.pk, "session": session.pk,
                    "turn": answer["turn"], "waiting_turn": waiting.pk, "approval": approval.pk,
                    "artifact": artifact.pk, "workflow": workflow.pk},
            "subjects": subjects, "tokens": tokens, "task_token": task_token_for(attempt),
            "keys": [connection.plain_key, other.plain_key]}


def _client(personas, persona) -> Client:
    client = Client()
    if persona != "anonymous":
        client.force_login(personas[persona])
    return client


def _audited_since(persona, personas, last_id) -> bool:
    user = personas[persona]
    return AuditEntry.objects.filter(id__gt=last_id, actor=user.username).exists()


def _judge_post(client, persona, personas, url, body, *, may_open: bool, before: dict, seen: list) -> dict:
    """POST; returns the database's fingerprint after it (the next POST's ``before``)."""
    last_audit = AuditEntry.objects.order_by("-id").values_list("id", flat=True).first() or 0
    response = client.post(url, data=body)
    where = f"{persona} POST {url} {sorted(body)[:6]}: {response.status_code}"
    assert response.status_code < 500, where
    after = fingerprint()
    changed = {t for t, digest in after.items() if before.get(t) != digest}
    if persona in CHANGES_NOTHING or not may_open:
        assert not changed, f"{where} changed {sorted(changed)}"
    elif changed and all(t.startswith("auth_") or t == "django_admin_log" for t in changed):
        # Users and role groups are Django's own admin: its log records who changed them.
        assert "django_admin_log" in changed, f"{where} changed {sorted(changed)} without a log entry"
    elif changed - {"chorus_site_auditentry"}:
        assert _audited_since(persona, personas, last_audit), f"{where} changed {sorted(changed)} without an audit entry"
    seen.append((f"POST {url}", response.content.decode(errors="replace")))
    return after


def test_every_admin_page_and_action_answers_each_persona_as_its_role_allows(personas, world):
    # One world for all personas (a transactional test's flush costs seconds): those who may
    # change nothing go first, then the operator and the ops_admin act on what is left.
    for persona in PERSONAS:
        _admin_matrix_for(persona, personas, world)


def _admin_matrix_for(persona, personas, world):
    client = _client(personas, persona)
    urls = admin_urls(world)
    assert len(urls) >= 130, len(urls)
    custom = {name for _url, name, model in urls if name and model and not STOCK_VIEW.search(name)}
    assert {"executions_run_cancel", "executions_run_task_action", "sessions_app_turn_interrupt",
            "sessions_app_session_handoff", "executions_issue_inbox"} <= custom, custom
    seen: list[tuple[str, str]] = []
    posts = []
    for url, name, model in urls:
        response = client.get(url)
        where = f"{persona} GET {url}: {response.status_code}"
        assert response.status_code < 500, where
        text = response.content.decode(errors="replace")
        if persona == "anonymous" and name not in {"login", "logout"}:
            assert response.status_code in {302, 404} and "/admin/login/" in response.get("Location", "/admin/login/"), where
        if persona == "outsider" and model is not None and model._meta.app_label in {"sessions_app", "executions"}:
            assert response.status_code != 200, where
        seen.append((f"GET {url}", text))
        if model is None or name.endswith("_history"):
            continue  # Django's own read-only or sign-in pages: nothing of ours to act on
        may_open = response.status_code == 200 and persona != "anonymous"
        if not may_open and persona in ACTORS:
            # A POST-only view (sending a message) refuses GET to everyone; any other page the
            # operator may not open, the ops_admin can: a POST to it must change nothing.
            may_open = persona == "ops_admin_user" or _client(personas, "ops_admin_user").get(url).status_code != 200
        body = {**direct_body(world), **form_of(text)} if response.status_code == 200 else direct_body(world)
        body.pop("csrfmiddlewaretoken", None)
        posts.append((url, body, may_open))
    for model, action in changelist_actions():
        meta = model._meta
        pk = model.objects.order_by("-pk").values_list("pk", flat=True).first()
        if pk is not None:
            posts.append((f"/admin/{meta.app_label}/{meta.model_name}/", {
                "action": action, "_selected_action": [str(pk)], "index": "0", "confirmed": "yes", "post": "yes"},
                True))
    before = fingerprint()
    for url, body, may_open in posts:
        before = _judge_post(client, persona, personas, url, body, may_open=may_open, before=before, seen=seen)
    if persona != "ops_admin_user":  # ops_admin registers connections: it is shown the new key once
        for where, text in seen:
            assert not harvested(text), f"{persona} harvested a credential from {where}"
            assert world["task_token"] not in text and not any(k in text for k in world["keys"]), where


def test_an_admin_action_without_the_csrf_token_is_refused(operator, world):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    before = fingerprint()
    response = client.post(f"/admin/executions/run/{world['ids']['run']}/cancel/", data={"reason": "no token"})
    assert response.status_code == 403
    assert fingerprint() == before


# ---------------------------------------------------------------- /ws/live/ and SSE per persona
@pytest.fixture
async def _close_worker_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


async def _ws(personas, persona):
    from chorus_site.asgi import application

    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if persona != "anonymous":
        client = Client()
        await sync_to_async(client.force_login)(personas[persona])
        headers.append((b"cookie", f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
                        .encode()))
    communicator = WebsocketCommunicator(application, "/ws/live/", headers=headers)
    connected, code = await communicator.connect(timeout=5)
    return communicator, connected, code


async def _frames_until(communicator, done, timeout=5.0) -> list[dict]:
    frames = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done(frames):
        frames.append(await communicator.receive_json_from(timeout=max(0.1, deadline - loop.time())))
    return frames


@pytest.mark.usefixtures("_close_worker_thread_connections")
async def test_live_socket_subscriptions_per_persona(personas, world):
    for persona in PERSONAS:
        await _live_socket_for(persona, personas, world)


async def _live_socket_for(persona, personas, world):
    ids = world["ids"]
    streams = ["dashboard", f"session:{ids['session']}", f"run:{ids['run']}", f"connection:{ids['connection']}",
               f"issue:{ids['issue']}"]
    communicator, connected, code = await _ws(personas, persona)
    if persona == "anonymous":
        assert not connected and code == 4401
        return
    assert connected
    frames = []
    for stream in streams:
        await communicator.send_json_to({"type": "subscribe", "stream": stream, "after": None if stream == "dashboard"
                                         else 0})
        answer = await _frames_until(communicator, lambda f: f and f[-1]["type"] in {"subscribed", "error"})
        frames += answer
        if persona == "outsider":
            assert answer[-1] == {"type": "error", "code": "not_found", "message": "no such stream", "stream": stream}
        else:
            assert answer[-1]["type"] == "subscribed", answer
    # A socket only follows: anything else it sends is refused and acts on nothing.
    before = await sync_to_async(fingerprint)()
    await communicator.send_json_to({"type": "interrupt", "turn": str(ids["turn"])})
    frames += await _frames_until(communicator, lambda f: f and f[-1]["type"] == "error")
    assert frames[-1]["code"] == "bad_request"
    assert await sync_to_async(fingerprint)() == before
    # Something happens live: the followers of the session (and of the dashboard) see it.
    await sync_to_async(event_append)(stream=f"session:{ids['session']}", kind="turn.note", data={"to": persona})
    if persona != "outsider":
        frames += await _frames_until(communicator, lambda f: any(
            m["type"] == "event" and m["event"]["data"] == {"to": persona} for m in f))
        assert sum(m["type"] == "event" for m in frames) >= 3
    else:
        assert await communicator.receive_nothing(timeout=0.5)
    await communicator.disconnect()
    text = json.dumps(frames)
    if persona != "ops_admin_user":
        assert not await sync_to_async(harvested)(text), persona
    assert world["task_token"] not in text and not any(k in text for k in world["keys"])


async def _sse_frames(response, stored: int) -> str:
    """The stream's text until its stored events arrived (deadline-bound), then it is closed."""
    buffer = ""
    iterator = response.streaming_content.__aiter__()

    async def pump():
        nonlocal buffer
        while buffer.count("\nid: ") + buffer.startswith("id: ") < stored:
            chunk = await iterator.__anext__()
            buffer += chunk.decode() if isinstance(chunk, bytes) else chunk

    try:
        await asyncio.wait_for(pump(), timeout=10)
    finally:
        await iterator.aclose()
    return buffer


@pytest.mark.usefixtures("_close_worker_thread_connections")
async def test_sse_streams_per_persona(personas, world):
    for kind in ("sessions", "runs"):
        for persona in (*PERSONAS, "agent", "daemon"):
            await _sse_for(kind, persona, personas, world)


async def _sse_for(kind, persona, personas, world):
    from chorus_site.models import Event

    object_id = world["ids"]["session" if kind == "sessions" else "run"]
    stream = f"{'session' if kind == 'sessions' else 'run'}:{object_id}"
    stored = await sync_to_async(Event.objects.filter(stream=stream).count)()
    assert stored >= 1
    url = f"/api/v1/{kind}/{object_id}/events/stream?after=0"
    bearer = {"agent": world["task_token"], "daemon": world["keys"][0]}.get(persona)
    answers = []
    cookie_client = AsyncClient()
    if persona in personas:
        await sync_to_async(cookie_client.force_login)(personas[persona])
        answers.append(await cookie_client.get(url))
        answers.append(await AsyncClient().get(url, headers={"Authorization": f"Bearer {world['tokens'][persona]}"}))
    else:
        answers.append(await AsyncClient().get(url, headers={"Authorization": f"Bearer {bearer}"} if bearer else {}))
    for response in answers:
        if persona in {"anonymous", "agent", "daemon"}:
            assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
        elif persona == "outsider":
            assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
        else:
            assert response.status_code == 200 and response["Content-Type"].startswith("text/event-stream")
            text = await _sse_frames(response, stored)
            if persona != "ops_admin_user":
                assert not await sync_to_async(harvested)(text), persona
            assert world["task_token"] not in text and not any(k in text for k in world["keys"])
