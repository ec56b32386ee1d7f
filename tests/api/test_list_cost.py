"""What one API list request costs the database (issue 9 item 4, SPEC §11 P5).

A list answer is the caller's token with its user and permissions (one statement) and the page
(one statement, joins included): the same count for a page of one row as for a full page, and no
permission query after the token lookup.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from chorus_site.permissions import VIEW_OPS
from chorus_site.tokens import token_authenticate, token_create
from tests import factories

pytestmark = pytest.mark.django_db


def token_client(user) -> Client:
    _token, raw = token_create(user=user, name="cost")
    return Client(HTTP_AUTHORIZATION=f"Bearer {raw}")


def statements(client: Client, path: str) -> list[str]:
    client.get(path)  # the first use stamps the token's last_used_at: not part of a steady request
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content
    return [q["sql"] for q in captured.captured_queries]


def fill(rows: int) -> None:
    """``rows`` of every listed kind, with the relations each page joins."""
    for _ in range(rows):
        _run, _node, task, _attempt = factories.make_run_graph()
        factories.make_attempt(task=task, state="failed")
        factories.make_turn(session=factories.make_session())


LISTS = ["/api/v1/sessions", "/api/v1/runs", "/api/v1/attempts", "/api/v1/connections", "/api/v1/issues"]


@pytest.mark.parametrize("path", LISTS)
def test_a_list_request_is_two_statements_whatever_the_page_holds(viewer, path):
    client = token_client(viewer)
    fill(1)
    one_row = statements(client, path)
    fill(6)
    full_page = statements(client, path + "?limit=5")
    assert len(one_row) == len(full_page) == 2, "\n".join(full_page)
    assert "auth_permission" in full_page[0] and "chorus_site_apitoken" in full_page[0]


def test_turns_of_a_session_are_three_statements(viewer):
    client = token_client(viewer)
    session = factories.make_session()
    factories.make_turn(session=session)
    one_turn = statements(client, f"/api/v1/sessions/{session.id}/turns")
    for _ in range(5):
        factories.make_turn(session=session)
    many = statements(client, f"/api/v1/sessions/{session.id}/turns?limit=5")
    assert len(one_turn) == len(many) == 3  # token with permissions, the session, the page


def test_a_sessions_page_shows_a_hand_off_without_a_query_per_row(viewer):
    client = token_client(viewer)
    old = factories.make_session()
    new = factories.make_session(connection=old.connection)
    new.handoff_from = old
    new.save(update_fields=["handoff_from"])
    sqls = statements(client, "/api/v1/sessions")
    assert len(sqls) == 2
    items = {item["id"]: item for item in client.get("/api/v1/sessions").json()["items"]}
    assert items[str(old.id)]["handoff_to"] == str(new.id)
    assert items[str(new.id)]["handoff_from"] == str(old.id)


def test_a_token_brings_its_users_permissions_along(viewer, django_assert_num_queries):
    _token, raw = token_create(user=viewer, name="perms")
    token_authenticate(raw)  # stamps last_used_at
    with django_assert_num_queries(1):
        user = token_authenticate(raw)
        assert user.has_perm(VIEW_OPS)
        assert not user.has_perm("sessions_app.interrupt_turn")  # a viewer's role does not act


def test_a_role_taken_away_holds_from_the_next_request(viewer):
    """Nothing is cached across requests: the permissions come with each token lookup."""
    client = token_client(viewer)
    assert client.get("/api/v1/sessions").status_code == 200
    viewer.groups.clear()
    assert client.get("/api/v1/sessions").status_code == 404  # no ops role: the objects do not exist


def test_a_logged_in_users_permissions_are_one_query(viewer, django_assert_num_queries):
    user = get_user_model().objects.get(pk=viewer.pk)
    with django_assert_num_queries(1):
        assert user.has_perm(VIEW_OPS)
        assert not user.has_perm("sessions_app.drain_connection")
        assert user.get_all_permissions() >= {VIEW_OPS}
