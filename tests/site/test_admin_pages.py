"""Every ops admin page answers for ops roles, refuses outsiders, and its query count is flat."""

from __future__ import annotations

import io

import pytest
from django.contrib import admin
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from sessions_app import services
from sessions_app.models import Turn
from tests import factories

pytestmark = pytest.mark.django_db

OPS_APPS = {"sessions_app", "executions"}
OPS_MODELS = [m for m in admin.site._registry if m._meta.app_label in OPS_APPS]


@pytest.fixture
def demo_data():
    call_command("chorus_demo", "--quiet-logins", stdout=io.StringIO())


def client_for(user):
    user.refresh_from_db()  # chorus_demo may have reset the password of a same-named demo user
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("model", OPS_MODELS, ids=lambda m: m._meta.label)
def test_changelist_and_detail_for_viewer_not_outsider(model, viewer, outsider, demo_data):
    changelist = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    assert client_for(outsider).get(changelist).status_code == 403
    response = client_for(viewer).get(changelist)
    assert response.status_code == 200
    obj = model.objects.first()
    assert obj is not None, "demo data should give every page something to show"
    detail = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_change", args=[obj.pk])
    assert client_for(outsider).get(detail).status_code == 403
    assert client_for(viewer).get(detail).status_code == 200


def test_index_shows_ops_sections_only_to_ops_roles(viewer, outsider):
    assert b"Sessions" in client_for(viewer).get("/admin/").content
    page = client_for(outsider).get("/admin/").content
    assert b"Sessions" not in page and b"Executions" not in page


def test_run_page_shows_the_task_map(viewer, demo_data):
    from executions.models import AgentTask

    retried = AgentTask.objects.filter(retry_of__isnull=False).select_related("node").first()
    page = client_for(viewer).get(reverse("admin:executions_run_change", args=[retried.node.run_id])).content.decode()
    assert f'data-task-id="{retried.pk}"' in page
    assert f'data-task-id="{retried.retry_of_id}"' in page
    assert "policy retry of" in page


def test_status_cannot_be_edited_in_the_admin(ops_admin_user, demo_data):
    turn = Turn.objects.filter(status="running").first()
    url = reverse("admin:sessions_app_turn_change", args=[turn.pk])
    response = client_for(ops_admin_user).post(url, {"status": "ended"})
    assert response.status_code == 403
    turn.refresh_from_db()
    assert turn.status == "running"


@pytest.mark.parametrize("url", ["/admin/sessions_app/turn/", "/admin/sessions_app/session/",
                                 "/admin/executions/run/", "/admin/executions/attempt/",
                                 "/admin/chorus_site/event/"])
def test_changelist_query_count_does_not_grow_with_rows(url, viewer, ops_admin_user):
    client = client_for(ops_admin_user)

    def queries():
        with CaptureQueriesContext(connection) as captured:
            assert client.get(url).status_code == 200
        return len(captured)

    session = factories.make_session()
    factories.make_run_graph()
    small = queries()
    for _ in range(30):
        turn = factories.make_turn(session=session)
        services.turn_set_status(turn_id=turn.pk, status="running")
        services.turn_set_status(turn_id=turn.pk, status="ended")
        factories.make_session(connection=session.connection)
        factories.make_run_graph()
    assert queries() == small


def test_search_by_uuid_finds_the_turn(viewer, demo_data):
    turn = Turn.objects.first()
    page = client_for(viewer).get(f"/admin/sessions_app/turn/?q={turn.session_id}").content.decode()
    assert f"/admin/sessions_app/turn/{turn.pk}/change/" in page
