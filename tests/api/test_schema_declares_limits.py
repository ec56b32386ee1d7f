"""R5: the OpenAPI document declares the limits and enums the server enforces on query parameters.

Generated from /api/v1/openapi.json: every query parameter of every GET route is probed with
values the server may refuse (0, -1 and a huge number for integers; an arbitrary word for
strings).  A parameter whose values the server refuses must declare what it accepts (bounds, an
``enum`` or a ``format``), and what it declares must be exactly what the server accepts: both
bounds accepted and one past each refused, every enum value accepted, a value outside refused.
Opaque cursors (``cursor``, ``after``) are validated but not enumerable.  Bodies likewise: a field
of a POST body that the server refuses with a list of what is ``allowed`` must declare that enum.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from chorus_site.api import api
from chorus_site.tokens import token_create
from tests import factories
from tests.api.test_access_matrix import world  # noqa: F401 — fixture: one object of every kind, credentials

pytestmark = pytest.mark.django_db

SCHEMA = api.get_openapi_schema()
OPAQUE = {"cursor", "after"}
ERROR_CODES = {"400", "401", "403", "404", "409", "413", "422", "429"}


def _query_parameters():
    for path, operations in SCHEMA["paths"].items():
        get = operations.get("get")
        if get is None or path.endswith("/events/stream"):  # a granted stream never ends; its cursor is opaque
            continue
        for parameter in get.get("parameters", []):
            if parameter["in"] == "query" and parameter["name"] not in OPAQUE:
                yield path, parameter


def _declared(parameter) -> dict:
    schema = parameter["schema"]
    return next((s for s in schema.get("anyOf", []) if s.get("type") != "null"), schema)


@pytest.fixture
def call(ops_admin_user):
    connection = factories.make_connection()
    session = factories.make_session(connection=connection)
    run, _node, _task, _attempt = factories.make_run_graph(connection=connection)
    ids = {"session_id": session.pk, "run_id": run.pk, "issue_id": run.issue_id, "connection_id": connection.pk,
           "turn_id": factories.make_turn(session=session).pk}
    _token, raw = token_create(user=ops_admin_user, name="schema-probe")
    client = Client()

    def get(path, name, value) -> int:
        url = path.format(**ids)
        return client.get(url, {name: value}, HTTP_AUTHORIZATION=f"Bearer {raw}").status_code

    return get


def test_every_enforced_query_limit_is_declared_exactly(call):
    probed = 0
    for path, parameter in _query_parameters():
        name, declared = parameter["name"], _declared(parameter)
        where = f"{path} ?{name}= declares {declared}"
        if declared.get("type") == "integer":
            refused = [v for v in (0, -1, 10**6) if call(path, name, v) == 400]
            if refused:
                assert "minimum" in declared and "maximum" in declared, f"{where}: the server refuses {refused}"
            if "minimum" in declared:
                assert call(path, name, declared["minimum"]) == 200, where
                assert call(path, name, declared["minimum"] - 1) == 400, where
            if "maximum" in declared:
                assert call(path, name, declared["maximum"]) == 200, where
                assert call(path, name, declared["maximum"] + 1) == 400, where
        elif declared.get("type") == "string" and declared.get("format") != "uuid":
            if call(path, name, "no-such-value-zq") == 400:
                assert {"enum", "format", "pattern"} & set(declared), f"{where}: the server refuses an arbitrary word"
            for value in declared.get("enum", []):
                assert call(path, name, value) == 200, f"{where}: {value!r} refused"
            if declared.get("format") == "date-time":
                assert call(path, name, "2026-01-01T00:00:00Z") == 200, where
        probed += 1
    assert probed >= 40


def test_every_operation_declares_the_error_answers():
    for path, operations in SCHEMA["paths"].items():
        for method, operation in operations.items():
            missing = ERROR_CODES - {str(code) for code in operation["responses"]}
            assert not missing, f"{method.upper()} {path} does not declare {sorted(missing)}"


def test_a_date_time_with_any_iso_offset_is_compared_in_utc(call):
    # Found by schemathesis once the format was declared: PostgreSQL refused the offset (a 500).
    assert call("/api/v1/runs", "created_after", "0007-12-30T02:14:31.367-17:34") == 200
    assert call("/api/v1/runs", "created_before", "2026-01-01T00:00:00+23:59") == 200
    assert call("/api/v1/runs", "created_after", "0001-01-01T00:00:00+05:00") == 400  # no UTC value


# A cwd is checked against the connection's own roots: data, not a schema's enum.
DATA_DEPENDENT = {"cwd"}


@pytest.mark.django_db(transaction=True)
def test_every_body_field_refused_with_an_allowed_list_declares_its_enum(world):
    """Each POST route's body, valid but for one free-text field set to an arbitrary word (as ops_admin):
    a 400 listing what is ``allowed`` means the server enforces an enum the schema must declare."""
    from tests.api.test_access_matrix import _example, _resolve

    token, undeclared, probed = world["credentials"]["ops_admin_user"], [], 0
    for path, operations in SCHEMA["paths"].items():
        body_schema = (operations.get("post", {}).get("requestBody", {}).get("content", {})
                       .get("application/json", {}).get("schema"))
        if not body_schema:
            continue
        url = path.format(**world["ids"])
        for name, sub in _resolve(body_schema).get("properties", {}).items():
            options = [_resolve(s) for s in _resolve(sub).get("anyOf", [_resolve(sub)])]
            strings = [o for o in options if o.get("type") == "string"]
            if not strings or any({"enum", "format"} & set(o) for o in strings) or name in DATA_DEPENDENT:
                continue
            body = {**(_example(body_schema, "", world["ids"]) or {}), name: "no-such-value-zq"}
            answer = Client().post(url, data=json.dumps(body), content_type="application/json",
                                   HTTP_AUTHORIZATION=f"Bearer {token}", REMOTE_ADDR="10.66.0.1")
            probed += 1
            if answer.status_code == 400 and "allowed" in answer.json()["error"].get("detail", {}):
                undeclared.append((path, name, answer.json()["error"]["detail"]["allowed"]))
    assert probed >= 15
    assert not undeclared, undeclared
