"""The read side of the API (SPEC §8): routes, auth, visibility by role, pagination, filters."""

from __future__ import annotations

import pytest
from django.test import Client

from chorus_site.models import AuditEntry
from chorus_site.tokens import token_create
from sessions_app import services
from tests import factories

pytestmark = pytest.mark.django_db

CANARY = "sk-ant-api03-CANARYcanaryCANARYcanary0123456789"

SPEC_GET_ROUTES = [
    "/api/v1/connections", "/api/v1/connections/{connection_id}",
    "/api/v1/sessions", "/api/v1/sessions/{session_id}",
    "/api/v1/sessions/{session_id}/turns", "/api/v1/sessions/{session_id}/transcript",
    "/api/v1/sessions/{session_id}/resume-preflight",
    "/api/v1/turns/{turn_id}", "/api/v1/turns/{turn_id}/diagnostics",
    "/api/v1/issues", "/api/v1/issues/{issue_id}", "/api/v1/issues/{issue_id}/comments",
    "/api/v1/inbox", "/api/v1/workflows",
    "/api/v1/runs", "/api/v1/runs/{run_id}",
    "/api/v1/tasks/{task_id}", "/api/v1/attempts", "/api/v1/attempts/{attempt_id}",
    "/api/v1/artifacts", "/api/v1/artifacts/{artifact_id}", "/api/v1/artifacts/{artifact_id}/content",
    "/api/v1/sessions/{session_id}/events", "/api/v1/runs/{run_id}/events",
    "/api/v1/sessions/{session_id}/events/stream", "/api/v1/runs/{run_id}/events/stream",
]


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def crashed_turn():
    turn = factories.make_turn()
    services.turn_set_status(turn_id=turn.pk, status="running")
    return services.turn_set_status(
        turn_id=turn.pk, status="interrupted", reason="crash",
        wake_error={"kind": "exited_nonzero", "exit_code": 2, "summary": "agent exited with code 2",
                    "details": f"starting\nOPENAI_API_KEY={CANARY}\nboom"},
    )


def test_openapi_lists_every_get_route_of_the_spec(client):
    document = client.get("/api/v1/openapi.json").json()
    listed = {path for path, ops in document["paths"].items() if "get" in ops}
    missing = [route for route in SPEC_GET_ROUTES if route not in listed]
    assert missing == []


def test_unauthenticated_is_401_with_the_error_body(client):
    response = client.get("/api/v1/sessions")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"


def test_outsider_gets_404_and_viewer_200_on_a_session(outsider, viewer):
    session = factories.make_session()
    url = f"/api/v1/sessions/{session.pk}"
    denied = client_for(outsider).get(url)
    assert denied.status_code == 404
    assert denied.json() == {"error": {"code": "not_found", "message": "not found", "detail": {}}}
    allowed = client_for(viewer).get(url)
    assert allowed.status_code == 200
    assert allowed.json()["id"] == str(session.pk)


@pytest.mark.parametrize("route", ["/api/v1/sessions", "/api/v1/runs", "/api/v1/connections", "/api/v1/issues",
                                   "/api/v1/attempts", "/api/v1/artifacts", "/api/v1/inbox", "/api/v1/workflows"])
def test_outsider_sees_no_ops_list(outsider, route):
    assert client_for(outsider).get(route).status_code == 404


def test_viewer_sees_summary_not_details(viewer):
    turn = crashed_turn()
    body = client_for(viewer).get(f"/api/v1/turns/{turn.pk}").json()
    assert body["wake_error"]["summary"] == "agent exited with code 2"
    assert body["wake_error"]["exit_code"] == 2
    assert body["wake_error"]["details"] is None
    assert body["wake_error"]["details_withheld"] is True
    raw = client_for(viewer).get(f"/api/v1/turns/{turn.pk}/diagnostics")
    assert raw.status_code == 403
    assert CANARY not in raw.content.decode()


def test_diagnostics_reader_sees_details_masked_and_each_view_is_audited(diagnostics_reader):
    turn = crashed_turn()
    client = client_for(diagnostics_reader)
    before = AuditEntry.objects.filter(action="diagnostics.view", target=f"turn:{turn.pk}").count()
    detail = client.get(f"/api/v1/turns/{turn.pk}").json()
    assert "boom" in detail["wake_error"]["details"]
    assert "[REDACTED]" in detail["wake_error"]["details"]
    raw = client.get(f"/api/v1/turns/{turn.pk}/diagnostics")
    assert raw.status_code == 200
    assert "boom" in raw.json()["wake_error"]["details"]
    for response in (detail, raw.json()):
        assert CANARY not in str(response)
    after = AuditEntry.objects.filter(action="diagnostics.view", target=f"turn:{turn.pk}").count()
    assert after - before == 2


def test_bearer_token_auth(viewer):
    session = factories.make_session()
    _token, raw = token_create(user=viewer, name="ci")
    client = Client()
    ok = client.get(f"/api/v1/sessions/{session.pk}", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert ok.status_code == 200
    bad = client.get(f"/api/v1/sessions/{session.pk}", HTTP_AUTHORIZATION=f"Bearer {raw[:-2]}xx")
    assert bad.status_code == 401


def test_cursor_pagination_walks_every_row_once(viewer):
    connection = factories.make_connection()
    created = {str(factories.make_session(connection=connection).pk) for _ in range(7)}
    client = client_for(viewer)
    seen, cursor = [], None
    while True:
        url = f"/api/v1/sessions?limit=3&connection={connection.pk}" + (f"&cursor={cursor}" if cursor else "")
        page = client.get(url).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(seen) == sorted(created)
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize("query, code", [
    ("limit=0", "bad_request"), ("limit=201", "bad_request"), ("cursor=%%%", "bad_request"),
    ("status=nonsense", "bad_request"), ("connection=not-a-uuid", "validation_error"),
])
def test_bad_list_input_is_a_clear_error(viewer, query, code):
    response = client_for(viewer).get(f"/api/v1/sessions?{query}")
    assert response.status_code in (400, 422)
    assert response.json()["error"]["code"] == code


def test_filters_apply(viewer):
    connection = factories.make_connection()
    target = factories.make_session(connection=connection, idea_key="idea:needle")
    factories.make_session(connection=connection, idea_key="idea:hay")
    items = client_for(viewer).get("/api/v1/sessions?q=needle").json()["items"]
    assert [item["id"] for item in items] == [str(target.pk)]


def test_takeover_only_when_backend_session_id_known(viewer):
    session = factories.make_session()
    client = client_for(viewer)
    assert client.get(f"/api/v1/sessions/{session.pk}").json()["takeover"] is None
    type(session).objects.filter(pk=session.pk).update(backend_session_id="abc-123")
    takeover = client.get(f"/api/v1/sessions/{session.pk}").json()["takeover"]
    assert takeover["backend_session_id"] == "abc-123"
    assert "abc-123" in takeover["command"]


def test_run_detail_has_the_graph(viewer):
    run, node, task, attempt = factories.make_run_graph()
    body = client_for(viewer).get(f"/api/v1/runs/{run.pk}").json()
    assert body["nodes"][0]["id"] == str(node.pk)
    assert body["nodes"][0]["tasks"][0]["id"] == str(task.pk)
    assert body["nodes"][0]["tasks"][0]["attempts"][0]["id"] == str(attempt.pk)


def test_events_route_returns_events_after_cursor(viewer):
    turn = factories.make_turn()
    stream = f"session:{turn.session_id}"
    events = factories.events_of(stream)
    services.turn_set_status(turn_id=turn.pk, status="running")
    body = client_for(viewer).get(f"/api/v1/sessions/{turn.session_id}/events?after={events[-1].id}").json()
    assert [e["kind"] for e in body["items"]] == ["turn.status"]
    assert body["items"][0]["data"]["status"] == "running"


def test_session_cookie_needs_csrf_on_unsafe_methods_but_bearer_does_not(operator):
    connection = factories.make_connection()
    body = {"connection": str(connection.pk), "cwd": "/srv/work", "prompt": "x"}
    cookie_client = Client(enforce_csrf_checks=True)
    cookie_client.force_login(operator)
    refused = cookie_client.post("/api/v1/sessions", data=body, content_type="application/json")
    assert refused.status_code == 403
    _token, raw = token_create(user=operator, name="csrf")
    with_token = Client(enforce_csrf_checks=True).post("/api/v1/sessions", data=body, content_type="application/json",
                                                        HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert with_token.status_code == 409  # past auth: the connection is offline
