"""The persona fixtures and the roles of SPEC §7 they stand for."""

from __future__ import annotations

import pytest
from django.test import RequestFactory
from django.contrib.auth import authenticate

from chorus_site import permissions
from tests.conftest import PASSWORD

ACTION = "sessions_app.interrupt_turn"
RUN_ACTION = "executions.cancel_run"
ADMIN_ONLY = "sessions_app.add_connection"

# persona -> (sees ops objects, sees raw diagnostics, may act, admin)
EXPECTED = {
    "outsider": (False, False, False, False),
    "viewer": (True, False, False, False),
    "operator": (True, False, True, False),
    "diagnostics_reader": (True, True, False, False),
    "ops_admin_user": (True, True, True, True),
}


@pytest.mark.django_db
def test_personas_have_their_roles(personas):
    assert set(personas) == set(EXPECTED)
    for name, user in personas.items():
        sees, diagnostics, acts, admin = EXPECTED[name]
        assert user.is_staff and user.is_active and not user.is_superuser
        assert permissions.has_ops_role(user) is sees, name
        assert permissions.can_view_diagnostics(user) is diagnostics, name
        assert user.has_perm(ACTION) is acts, name
        assert user.has_perm(RUN_ACTION) is acts, name
        assert user.has_perm(ADMIN_ONLY) is admin, name


@pytest.mark.django_db
def test_persona_groups(outsider, viewer, operator, diagnostics_reader, ops_admin_user):
    assert list(outsider.groups.values_list("name", flat=True)) == []
    assert list(viewer.groups.values_list("name", flat=True)) == [permissions.VIEWER]
    assert list(operator.groups.values_list("name", flat=True)) == [permissions.OPERATOR]
    assert list(diagnostics_reader.groups.values_list("name", flat=True)) == [permissions.DIAGNOSTICS]
    assert list(ops_admin_user.groups.values_list("name", flat=True)) == [permissions.ADMIN]


@pytest.mark.django_db
def test_personas_log_in_with_the_shared_password(personas, persona_password):
    assert persona_password == PASSWORD == "pw-Chorus-123"
    login = RequestFactory().post("/admin/login/")  # django-axes (login lockout) needs the request
    for user in personas.values():
        assert authenticate(login, username=user.username, password=PASSWORD) == user
        assert authenticate(login, username=user.username, password="wrong") is None


@pytest.mark.django_db(transaction=True)
def test_personas_work_in_transactional_tests_too(personas):
    # A transactional test flushes the role groups when it ends; the fixtures recreate them.
    assert permissions.has_ops_role(personas["viewer"])
    assert permissions.can_view_diagnostics(personas["diagnostics_reader"])


@pytest.mark.django_db(transaction=True)
def test_personas_after_a_flush(operator):
    assert operator.has_perm(ACTION)
