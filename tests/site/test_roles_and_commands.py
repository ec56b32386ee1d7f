"""Roles of SPEC §7 as created by the data migration, and the token command."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from chorus_site.models import ApiToken
from chorus_site.permissions import ACTION_PERMISSIONS, ADMIN_ONLY_ACTIONS
from tests import factories

pytestmark = pytest.mark.django_db

ACTIONS = [f"{app}.{code}" for app, models in ACTION_PERMISSIONS.items() for perms in models.values()
           for code, _ in perms if code not in ADMIN_ONLY_ACTIONS]


def test_viewer_sees_but_may_do_nothing(viewer):
    assert viewer.has_perm("sessions_app.view_session") and viewer.has_perm("executions.view_run")
    assert not any(viewer.has_perm(p) for p in ACTIONS)
    assert not viewer.has_perm("sessions_app.view_diagnostics")


def test_operator_may_do_every_action_but_read_no_raw_diagnostics(operator):
    assert all(operator.has_perm(p) for p in ACTIONS)
    assert not operator.has_perm("sessions_app.view_diagnostics")
    assert not operator.has_perm("sessions_app.add_connection")
    assert not operator.has_perm("sessions_app.drain_connection")  # ops_admin only (§7)


def test_diagnostics_reader_reads_details_and_nothing_more(diagnostics_reader):
    assert diagnostics_reader.has_perm("sessions_app.view_diagnostics")
    assert not any(diagnostics_reader.has_perm(p) for p in ACTIONS)


def test_ops_admin_manages_connections_workflows_tokens_and_roles(ops_admin_user):
    for perm in ["sessions_app.add_connection", "sessions_app.drain_connection", "executions.add_workflowdefinition", "chorus_site.add_apitoken",
                 "auth.change_group", "sessions_app.view_diagnostics", *ACTIONS]:
        assert ops_admin_user.has_perm(perm), perm


def test_outsider_has_no_ops_permission(outsider):
    assert not outsider.get_all_permissions()


def test_token_command_prints_a_working_token_last(viewer):
    session = factories.make_session()
    out = io.StringIO()
    call_command("chorus_token", "create", "--user", viewer.username, "--name", "laptop", stdout=out)
    raw = out.getvalue().strip().splitlines()[-1]
    token = ApiToken.objects.get(user=viewer, name="laptop")
    assert raw.startswith(f"cho_{token.prefix}_")
    assert raw.split("_", 2)[2] not in token.secret_hash
    client = Client()
    assert client.get(f"/api/v1/sessions/{session.pk}", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    call_command("chorus_token", "revoke", token.prefix, stdout=io.StringIO())
    assert client.get(f"/api/v1/sessions/{session.pk}", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401


def test_token_command_refuses_unknown_user():
    with pytest.raises(CommandError, match="no user named"):
        call_command("chorus_token", "create", "--user", "nobody-here", stdout=io.StringIO())
