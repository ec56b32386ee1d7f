"""Bad input never crashes or wedges (issue 8 item 7, SPEC §8).

Every POST route of the OpenAPI (so a new route is covered without editing this file) gets, in
each of its text fields, a NUL, a lone surrogate and an oversize value, with the credential its
operation declares (an operator's API token, the attempt's task token, the connection's key): the
answer is never a 5xx and an error always has the §8 body.  Then the named reproductions of the
issue, the error pages of the API (unknown route, wrong method, malformed JSON, a body over
DATA_UPLOAD_MAX_MEMORY_SIZE) and of the admin.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from chorus_site.api import api
from chorus_site.tokens import token_create
from executions.models import Artifact, Comment, Issue
from executions.task_tokens import task_token_for
from sessions_app.models import Connection, Session, Turn
from tests import factories

pytestmark = pytest.mark.django_db

SCHEMA = api.get_openapi_schema()
COMPONENTS = SCHEMA["components"]["schemas"]
OVERSIZE = "x" * (300 * 1024)  # over CHORUS_PROMPT_MAX_BYTES (256 KiB) and every column's length
BAD_VALUES = {
    "nul": "bad\x00text",
    "surrogate": "half \ud800 char",  # json.dumps writes it as the escape "\ud800"
    "oversize": OVERSIZE,
}


def _resolve(schema: dict) -> dict:
    if "$ref" in schema:
        return _resolve(COMPONENTS[schema["$ref"].rsplit("/", 1)[1]])
    for alternative in schema.get("anyOf", ()):
        if alternative.get("type") != "null":
            return _resolve(alternative)
    return schema


# Values a route needs to get past its first check, by field name.
HINTS = {"input": {"prompt": "ordinary text"}, "spec": {"nodes": [{"key": "main", "type": "agent", "prompt": "do it"}]},
         "status": "running", "kind": "text", "data": {"text": "ordinary text"}}


def _hint(name: str, schema: dict):
    hint = HINTS.get(name)
    kind = {"object": dict, "string": str}.get(schema.get("type"))
    return hint if kind is not None and isinstance(hint, kind) else None


def _optional_included(name: str, schema: dict, world: dict) -> bool:
    """Optional fields a sample carries: free text and free-form objects (where bad text can go),
    and ids of the world's objects."""
    schema = _resolve(schema)
    if _hint(name, schema) is not None:
        return True
    if schema.get("format") == "uuid":
        return name in world["ids"] and name != "workflow_revision"
    return schema.get("type") in ("string", "object") and "enum" not in schema


def _sample(schema: dict, name: str, world: dict):
    """A valid-looking value for a schema: ids of the world's objects, the first enum value, ..."""
    schema = _resolve(schema)
    if "enum" in schema:
        return HINTS[name] if HINTS.get(name) in schema["enum"] else schema["enum"][0]
    if _hint(name, schema) is not None:
        return json.loads(json.dumps(_hint(name, schema)))
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        return {key: _sample(sub, key, world) for key, sub in schema["properties"].items()
                if key in schema.get("required", ()) or _optional_included(key, sub, world)}
    if schema.get("default") is not None:
        return schema["default"]
    if kind == "object":
        return {}
    if kind == "array":
        return [_sample(schema["items"], name, world)]
    if kind == "integer":
        return max(1, schema.get("minimum", 1))
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return False
    if schema.get("format") == "uuid":
        return world["ids"].get(name, world["ids"]["issue"])
    if name in ("cwd", "cwds"):
        return "/srv/work/app"
    return "ordinary text"


def _text_leaves(value, path=()):
    """Paths of every string in a sample body, plus a free-form key of each plain object."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _text_leaves(item, path + (i,))
    elif isinstance(value, dict):
        if not value:
            yield path + ("note",)  # free-form (input, spec, data, ...): a new key's text
        for key, item in value.items():
            yield from _text_leaves(item, path + (key,))


def _with(value, path, bad):
    if not path:
        return bad
    value = json.loads(json.dumps(value))
    node = value
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = bad
    return value


def _post_operations():
    for path, operations in SCHEMA["paths"].items():
        op = operations.get("post")
        if op is None:
            continue
        schemes = {name for requirement in op.get("security", ()) for name in requirement}
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        yield path, schemes, body


def _targets(path, body_schema):
    """Where a bad value goes: every text leaf of the body, every text path parameter."""
    world_stub = {"ids": {name: "00000000-0000-0000-0000-000000000000" for name in WORLD_IDS}}
    sample = _sample(body_schema, "body", world_stub) if body_schema else None
    targets = [("body",) + leaf for leaf in _text_leaves(sample)] if sample is not None else []
    targets += [("path", p) for p in _string_path_params(path)]
    return targets or [("body", "note")]  # no body at all: send one anyway


def _string_path_params(path):
    op = SCHEMA["paths"][path]["post"]
    return [p["name"] for p in op.get("parameters", ()) if p["in"] == "path"
            and _resolve(p["schema"]).get("type") == "string" and _resolve(p["schema"]).get("format") != "uuid"]


@pytest.fixture
def world(operator, ops_admin_user):
    connection = factories.make_connection(cwds=["/srv/work"], status="online")
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now())
    session = factories.make_session(connection=connection, cwd="/srv/work/app")
    turn = factories.make_turn(session=session, status="running")
    issue = factories.make_issue()
    run, node, task, attempt = factories.make_run_graph(issue=issue, connection=connection)
    task.leader = True
    task.save(update_fields=["leader"])
    approval = factories.make_approval(node=node)
    from executions import workflows
    revision = workflows.workflow_create(name=factories.unique("wf"), description="", spec={"nodes": [
        {"key": "main", "type": "agent", "prompt": "do it"}]}, actor=operator)
    _, operator_token = token_create(user=operator)
    _, admin_token = token_create(user=ops_admin_user)
    ids = {"connection": connection.pk, "connection_id": connection.pk, "session": session.pk,
           "session_id": session.pk, "turn_id": turn.pk, "issue": issue.pk, "issue_id": issue.pk, "run": run.pk,
           "run_id": run.pk, "task_id": task.pk, "attempt": attempt.pk, "attempt_id": attempt.pk,
           "approval_id": approval.pk, "workflow_id": revision.workflow_id, "workflow_revision": revision.pk,
           "turn": turn.pk}
    return {"ids": {k: str(v) for k, v in ids.items()},
            "auth": {"TokenAuth": operator_token, "admin": admin_token, "TaskTokenAuth": task_token_for(attempt),
                     "ConnectionKeyAuth": connection.plain_key}}


def _credential(schemes, world):
    for scheme in ("TokenAuth", "TaskTokenAuth", "ConnectionKeyAuth"):
        if scheme in schemes:
            return world["auth"][scheme]
    raise AssertionError(f"no known security scheme in {schemes}")


def assert_error_body(response):
    assert response["Content-Type"].startswith("application/json"), (response.status_code, response.content[:300])
    error = response.json()["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str) and isinstance(error["detail"], dict)


def _url(path, world, bad_param=None, bad=""):
    if bad_param:
        path = path.replace("{" + bad_param + "}", quote(bad.encode("utf-8", "surrogatepass"), safe=""))
    for name, value in world["ids"].items():
        path = path.replace("{" + name + "}", value)
    return path.replace("{name}", "go")


POST_OPERATIONS = list(_post_operations())
WORLD_IDS = ("connection", "connection_id", "session", "session_id", "turn", "turn_id", "issue", "issue_id", "run",
             "run_id", "task_id", "attempt", "attempt_id", "approval_id", "workflow_id", "workflow_revision")


def _post(url, body, auth):
    return Client(raise_request_exception=False).post(url, data=json.dumps(body), content_type="application/json",
                                                      **auth)


def _operation_params():
    for path, schemes, body_schema in POST_OPERATIONS:
        # mark-interrupted probes the daemon outside any transaction: it cannot run inside the
        # test's own; the other routes run in one, which is much faster to undo than a flush.
        marks = [pytest.mark.django_db(transaction=True)] if path.endswith("/mark-interrupted") else []
        yield pytest.param(path, schemes, body_schema, marks=marks, id=f"POST {path}")


@pytest.mark.parametrize("path,schemes,body_schema", list(_operation_params()))
def test_bad_text_in_every_post_field_is_never_a_server_error(world, path, schemes, body_schema):
    """A NUL, a lone surrogate and an oversize value in each text field of each POST route, with the
    credential the route declares: never a 5xx, and every refusal has the §8 body."""
    auth = {"HTTP_AUTHORIZATION": f"Bearer {_credential(schemes, world)}"}
    if path.endswith("/mark-interrupted"):  # evidence without a probe (which waits for the daemon)
        Connection.objects.update(status="offline")
    failures = []
    base = _sample(body_schema, "body", world) if body_schema else {}
    plain = _post(_url(path, world), base, auth)
    if plain.status_code == 403 and "TokenAuth" in schemes:  # an admin's route (connections, workflows)
        auth = {"HTTP_AUTHORIZATION": f"Bearer {world['auth']['admin']}"}
        plain = _post(_url(path, world), base, auth)
    assert plain.status_code < 500, plain.content[:300]
    for target in _targets(path, body_schema):
        for bad_name, bad in BAD_VALUES.items():
            body = _sample(body_schema, "body", world) if body_schema else {}
            if target[0] == "body":
                body, url = _with(body, target[1:], bad), _url(path, world)
            else:
                url = _url(path, world, target[1], bad)
            response = _post(url, body, auth)
            where = f"{'.'.join(map(str, target[1:]))}={bad_name}"
            if response.status_code >= 500:
                failures.append((where, response.status_code, response.content[:80]))
            elif response.status_code >= 400:
                try:
                    assert_error_body(response)
                except (AssertionError, KeyError, ValueError) as exc:
                    failures.append((where, response.status_code, repr(exc)[:200]))
    assert failures == [], "\n".join(f"{w}: {c} {b!r}" for w, c, b in failures)


# ---------------------------------------------------------------- the reproductions of item 7
def operator_client(operator) -> Client:
    client = Client()
    client.force_login(operator)
    return client


def post(client, url, body=None, raw=None):
    return client.post(url, data=raw if raw is not None else json.dumps(body), content_type="application/json")


def test_nul_and_a_lone_surrogate_in_operator_text_are_stored_replaced(operator, world):
    client = operator_client(operator)
    response = post(client, "/api/v1/issues", raw='{"title": "Fix\\u0000 the \\ud800 build", "body": "b\\u0000"}')
    assert response.status_code == 201, response.content
    issue = Issue.objects.get(pk=response.json()["id"])
    assert (issue.title, issue.body) == ("Fix\ufffd the \ufffd build", "b\ufffd")
    response = post(client, f"/api/v1/issues/{issue.pk}/comments", raw='{"body": "nul\\u0000 and \\udfff"}')
    assert response.status_code == 201, response.content
    assert Comment.objects.get(pk=response.json()["id"]).body == "nul\ufffd and \ufffd"
    response = post(client, "/api/v1/sessions", raw=json.dumps(
        {"connection": world["ids"]["connection"], "cwd": "/srv/work/app", "prompt": "do\x00 it \ud800",
         "title": "t\x00"}))
    assert response.status_code == 201, response.content
    turn = Turn.objects.get(pk=response.json()["turn"])
    assert turn.prompt == "do\ufffd it \ufffd"
    assert Session.objects.get(pk=turn.session_id).title == "t\ufffd"


def test_a_title_over_255_characters_is_422_with_the_limit(operator):
    response = post(operator_client(operator), "/api/v1/issues", {"title": "t" * 256})
    assert response.status_code == 422, response.content
    assert_error_body(response)
    assert Issue.objects.count() == 0


def test_an_artifact_name_with_cr_lf_or_non_latin1_is_served_safely(operator, world):
    client = operator_client(operator)
    for name in ("report\r\nSet-Cookie: x=1.txt", "отчёт-ü-✓.txt"):
        response = post(client, "/api/v1/artifacts", {"issue": world["ids"]["issue"], "kind": "report",
                                                      "name": name, "content": "hello"})
        assert response.status_code in (201, 422), response.content
        if response.status_code == 422:
            assert_error_body(response)
            continue
        content = client.get(f"/api/v1/artifacts/{response.json()['id']}/content")
        assert content.status_code == 200
        assert content.content == b"hello"
        header = content["Content-Disposition"]
        assert "\r" not in header and "\n" not in header and "Set-Cookie" not in content.headers
        header.encode("latin-1")  # a header Django can send


def test_an_artifact_naming_an_unknown_issue_or_run_is_404(operator, world):
    client = operator_client(operator)
    unknown = "9b0f4a8e-0000-4000-8000-000000000000"
    for body in ({"issue": unknown}, {"issue": world["ids"]["issue"], "run": unknown},
                 {"issue": world["ids"]["issue"], "attempt": unknown}):
        response = post(client, "/api/v1/artifacts", {"kind": "report", "name": "r.txt", "content": "x", **body})
        assert response.status_code == 404, (body, response.content)
        assert_error_body(response)
    assert Artifact.objects.count() == 0


# ---------------------------------------------------------------- error pages of the API
def test_the_api_never_answers_an_html_error_page(operator, world):
    client = operator_client(operator)
    unknown_route = client.get("/api/v1/no-such-route")
    assert unknown_route.status_code == 404
    assert_error_body(unknown_route)
    wrong_method = client.delete("/api/v1/issues")
    assert wrong_method.status_code == 405
    assert_error_body(wrong_method)
    assert "GET" in wrong_method["Allow"]
    malformed = post(client, "/api/v1/issues", raw='{"title": "unterminated')
    assert malformed.status_code == 400
    assert_error_body(malformed)
    too_big = post(client, "/api/v1/issues", raw=json.dumps(
        {"title": "big", "body": "x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)}))
    assert too_big.status_code == 413, too_big.content[:300]
    assert_error_body(too_big)
    assert too_big.json()["error"]["code"] == "payload_too_large"
    unauthenticated = Client().get("/api/v1/no-such-route")
    assert unauthenticated.status_code == 404
    assert_error_body(unauthenticated)


@pytest.mark.parametrize("url,status", [("/admin/no-such-page/", 404), ("/no-such-page", 404)])
def test_admin_error_pages_are_ours_with_a_way_back(operator, url, status):
    response = operator_client(operator).get(url)
    assert response.status_code == status
    page = response.content.decode()
    assert "Chorus Ops" in page and 'href="/admin/"' in page, page[:500]


def test_the_400_403_and_500_pages_are_ours_too(rf):
    from django.core.exceptions import PermissionDenied, SuspiciousOperation
    from django.views import defaults

    request = rf.get("/admin/somewhere/")
    pages = {400: defaults.bad_request(request, SuspiciousOperation("bad")),
             403: defaults.permission_denied(request, PermissionDenied()),
             500: defaults.server_error(request)}
    for status, response in pages.items():
        assert response.status_code == status
        page = response.content.decode()
        assert "Chorus Ops" in page and 'href="/admin/"' in page, (status, page[:300])


@pytest.mark.django_db(transaction=True)
def test_an_events_report_with_nul_and_a_lone_surrogate_lands_and_the_turn_settles(operator):
    """The daemon's path: one NUL used to fail the events report with a 500 on every retry (the
    turn stayed running, the spool never drained); a lone surrogate was refused."""
    import uuid

    connection = factories.make_connection(cwds=["/srv/work"], status="online")
    Connection.objects.filter(pk=connection.pk).update(last_heartbeat_at=timezone.now())
    started = post(operator_client(operator), "/api/v1/sessions",
                   {"connection": str(connection.pk), "cwd": "/srv/work/app", "prompt": "@reply hi"})
    assert started.status_code == 201, started.content
    turn = Turn.objects.get(pk=started.json()["turn"])
    daemon = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {connection.plain_key}"}

    def report(kind, raw):
        return daemon.post(f"/api/v1/daemon/turns/{turn.pk}/{kind}", data=raw, content_type="application/json", **auth)

    assert report("advance", json.dumps({"report_id": str(uuid.uuid4()), "status": "running", "pid": 4242})
                  ).status_code == 200
    raw = ('{"report_id": "%s", "events": [{"kind": "text", "data": {"text": "nul \\u0000 and half \\ud800 here"}},'
           ' {"kind": "text", "data": {"text": "lone \\udfff low"}}]}' % uuid.uuid4())
    landed = report("events", raw)
    assert landed.status_code == 200, landed.content
    assert landed.json()["accepted"] == 2
    texts = [e.data["data"]["text"] for e in factories.events_of(turn.stream, kind="turn.output")]
    assert texts == ["nul \ufffd and half \ufffd here", "lone \ufffd low"]
    ended = report("advance", json.dumps({"report_id": str(uuid.uuid4()), "status": "ended",
                                          "final_reply": "done \x00 \ud800"}))
    assert ended.status_code == 200, ended.content
    turn.refresh_from_db()
    assert (turn.status, turn.final_reply) == ("ended", "done \ufffd \ufffd")
