"""R7 access matrix: every route of the OpenAPI × every persona × its method (issue 8).

Generated from /api/v1/openapi.json, so a new route is covered without editing this file.  Each
route is called with a body synthesised from its request schema (so permission checks, not body
validation, decide) by: nobody, an outsider, each ops role, an agent's task token (its own
attempt and another's), and a daemon's connection key (its own connection and another's).

What must hold, derived from the route's declared security:
- never a server error; every refusal carries the §8 error body;
- a credential of a kind the route does not take (a task token or a connection key on operator
  routes, a user token on agent or daemon routes, nothing at all) is 401;
- users without an ops role never succeed and never learn that an object exists (no 200, no 403);
- a viewer and a diagnostics reader succeed on no acting (POST) route;
- swapped ids: another attempt's task token and another connection's key succeed on nothing of A;
- nobody below ops_admin obtains a usable credential from any answer.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from django.test import Client
from django.utils import timezone

from chorus_site.api import api
from chorus_site.tokens import token_create
from executions.models import Approval, Artifact, WorkflowDefinition
from executions.task_tokens import attempt_for_task_token, task_token_for
from sessions_app import bridge
from sessions_app.models import Connection
from tests import factories

# Transactional: some actions (mark-interrupted) refuse to run inside an outer transaction.
pytestmark = pytest.mark.django_db(transaction=True)

USER_SCHEMES = {"SessionCookieAuth", "TokenAuth"}
USER_PERSONAS = ("outsider", "viewer", "operator", "diagnostics_reader", "ops_admin_user")
PERSONAS = ("anonymous", "agent", "other_agent", "daemon", "other_daemon", *USER_PERSONAS)
SCHEMA = api.get_openapi_schema()
ROUTES = [(method.upper(), path, op) for path, ops in SCHEMA["paths"].items() for method, op in ops.items()]
CREDENTIAL = re.compile(r"\b(?:cht|chk|cho)_[A-Za-z0-9_:\-.]{8,}")
_addresses = (f"10.{a}.{b}.{c}" for a, b, c in itertools.product(range(1, 255), repeat=3))


def _schemes(op) -> set[str]:
    return {name for requirement in op.get("security", []) for name in requirement}


def _resolve(schema):
    while "$ref" in schema:
        schema = SCHEMA["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _example(schema, name: str, ids: dict):
    """A value that validates against ``schema``; uuids named like an object get that object's id."""
    schema = _resolve(schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [s for s in schema[key] if _resolve(s).get("type") != "null"]
            return _example(options[0], name, ids) if options else None
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        # Required fields, and optional ones that name an object (issue, run, attempt, connection):
        # those are what a swapped-id request tries to reach.
        return {key: _example(sub, key, ids) for key, sub in props.items()
                if key in schema.get("required", []) or key in ids}
    if kind == "array":
        return [_example(schema["items"], name, ids)] if schema.get("minItems") else []
    if kind == "integer":
        return max(1, schema.get("minimum", 1))
    if kind == "number":
        return 1
    if kind == "boolean":
        return False
    if schema.get("format") == "uuid":
        return str(ids.get(name, ids["issue"]))
    return {"cwd": "/srv/work", "mode": "direct", "kind": "report", "decision": "approve",
            "intent": "succeeded"}.get(name, "x" * max(1, schema.get("minLength", 1)))


@pytest.fixture
def world(personas):
    conn_a = factories.make_connection(cwds=["/srv/work"])
    conn_b = factories.make_connection(cwds=["/srv/work"])
    Connection.objects.filter(pk__in=[conn_a.pk, conn_b.pk]).update(status="online",
                                                                    last_heartbeat_at=timezone.now())
    turn_a = factories.make_turn(session=factories.make_session(connection=conn_a), status="running")
    run_a, _node, task_a, attempt_a = factories.make_run_graph(connection=conn_a)
    _run_b, _node_b, _task_b, attempt_b = factories.make_run_graph(connection=conn_b)
    artifact = Artifact.objects.create(issue=run_a.issue, run=run_a, kind="report", name="a.md", content="# a",
                                       sha256="0" * 64, size=3)
    workflow = WorkflowDefinition.objects.create(name="wf-matrix")
    approval = factories.make_approval(node=_node)
    ids = {"connection_id": conn_a.pk, "session_id": turn_a.session_id, "turn_id": turn_a.pk, "issue_id": run_a.issue_id,
           "run_id": run_a.pk, "task_id": task_a.pk, "attempt_id": attempt_a.pk, "artifact_id": artifact.pk,
           "workflow_id": workflow.pk, "approval_id": approval.pk, "name": "go",
           # body fields
           "connection": conn_a.pk, "issue": run_a.issue_id, "run": run_a.pk, "attempt": attempt_a.pk}
    credentials = {"anonymous": None, "agent": task_token_for(attempt_a), "other_agent": task_token_for(attempt_b),
                   "daemon": conn_a.plain_key, "other_daemon": conn_b.plain_key}
    for name in USER_PERSONAS:
        credentials[name] = token_create(user=personas[name], name="matrix")[1]
    return {"ids": ids, "credentials": credentials, "turn_a": turn_a}


def _call(method, path, op, credential, ids):
    url = re.sub(r"{(\w+)}", lambda m: str(ids[m.group(1)]), path)
    headers = {"REMOTE_ADDR": next(_addresses)}  # one address per call: the brute-force counter is tested elsewhere
    if credential:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {credential}"
    if method == "GET":
        return Client().get(url, **headers), {}
    body_schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    body = (_example(body_schema, "", ids) if body_schema else None) or {}
    return Client().post(url, data=json.dumps(body), content_type="application/json", **headers), body


def _expect(persona, method, path, op, status, names_an_object: bool):
    schemes = _schemes(op)
    accepted = {"anonymous": False, "agent": "TaskTokenAuth" in schemes, "other_agent": "TaskTokenAuth" in schemes,
                "daemon": "ConnectionKeyAuth" in schemes, "other_daemon": "ConnectionKeyAuth" in schemes,
                **{name: bool(schemes & USER_SCHEMES) for name in USER_PERSONAS}}
    where = f"{persona} {method} {path}: {status}"
    if not accepted[persona]:
        assert status == 401, where  # a credential of a kind this route does not take, or none
        return
    if persona == "outsider":
        assert status in {400, 404, 422}, where  # the objects do not exist for it
    if persona in {"viewer", "diagnostics_reader"} and method == "POST":
        assert not 200 <= status < 300, where
    if persona in {"other_agent", "other_daemon"} and names_an_object:
        assert not 200 <= status < 300, where  # another attempt's token / connection's key: nothing of A
    if persona in {"viewer", "operator"} and path.endswith("/diagnostics"):
        assert status in {403, 404}, where
    if persona in {"viewer", "operator", "diagnostics_reader", "ops_admin_user"} and method == "GET" \
            and schemes & USER_SCHEMES and not path.endswith("/diagnostics"):
        assert status == 200, where


@pytest.mark.parametrize("persona", PERSONAS)
def test_every_route_answers_each_persona_as_its_role_allows(persona, world):
    seen = 0
    for method, path, op in ROUTES:
        if path.endswith("/events/stream") and persona in {"viewer", "operator", "diagnostics_reader",
                                                           "ops_admin_user"}:
            continue  # a granted SSE stream never ends; tests/api/test_sse.py and tests/e2e cover it
        response, body = _call(method, path, op, world["credentials"][persona], world["ids"])
        status = response.status_code
        assert status < 500, f"{persona} {method} {path}: {status} {response.content[:300]!r}"
        if status >= 400:
            error = response.json()["error"]
            assert error["code"] and isinstance(error["message"], str), f"{persona} {method} {path}"
        names_an_object = "{" in path or any(key in body for key in ("issue", "run", "attempt", "connection"))
        _expect(persona, method, path, op, status, names_an_object)
        if persona != "ops_admin_user":
            text = response.content.decode(errors="replace")
            for candidate in CREDENTIAL.findall(text):
                assert (attempt_for_task_token(candidate) is None
                        and bridge.connection_authenticate(candidate) is None), f"{persona} {method} {path}"
        seen += 1
    assert seen >= 50


def test_the_matrix_covers_every_declared_route():
    declared = {(m, p) for m, p, _ in ROUTES}
    assert len(declared) >= 60
    assert all(_schemes(op) for _m, _p, op in ROUTES), "a route without declared security"
