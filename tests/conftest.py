"""Shared fixtures: the five personas of SPEC §7 and small helpers every test module may use.

The role groups come from the data migration ``chorus_site/migrations/0002_roles.py``.  A
``transaction=True`` test flushes every table when it ends (groups included), so a later test
may find them gone: ``role_group`` then recreates them with the same ``roles_sync`` the
migration uses, instead of failing for a reason that has nothing to do with the test.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.test.utils import override_settings

from chorus_site import permissions
from tests import factories

# The test process itself runs race tests with up to a dozen threads, each on a connection of its
# own, all at once; the portal's per-process pool (DATABASE_POOL_MAX_SIZE, 4 by default: sized for
# request threads that take turns) would make them wait on each other instead of racing. The pool
# is built on the first connection, so widening it here, at import, is in time. Portal processes
# the tests start keep the configured size.
TEST_PROCESS_POOL_MAX = 24


def _widen_the_test_process_pool():
    from django.db import connections

    pool = connections["default"].settings_dict.get("OPTIONS", {}).get("pool")
    if isinstance(pool, dict):
        pool["max_size"] = max(pool["max_size"], TEST_PROCESS_POOL_MAX)


_widen_the_test_process_pool()


def _no_presence_thread_in_the_test_process():
    """Tests that drive the ASGI app in-process import chorus_site.asgi, which starts the portal's
    presence refresher: in the test process it would write PortalPresence into every later test's
    database each second (sweep tests would see a portal that is up, or one that went down) and hold
    a pooled connection. The portal processes the tests start keep it (their settings are their own)."""
    from django.conf import settings

    settings.CHORUS_PORTAL_PRESENCE = False


_no_presence_thread_in_the_test_process()

PASSWORD = factories.PASSWORD

# fixture name -> (username, role group or None)
PERSONAS = {
    "outsider": ("outsider", None),
    "viewer": ("viewer", permissions.VIEWER),
    "operator": ("operator", permissions.OPERATOR),
    "diagnostics_reader": ("diagnostics_reader", permissions.DIAGNOSTICS),
    "ops_admin_user": ("ops_admin_user", permissions.ADMIN),
}


@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing():
    """The production hasher spends ~0.2 s per hash by design; tests make and log in many users."""
    override = override_settings(PASSWORD_HASHERS=[
        "django.contrib.auth.hashers.MD5PasswordHasher",
        # kept so browser tests can give a user a hash the separate portal process verifies
        "django.contrib.auth.hashers.PBKDF2PasswordHasher",
    ])
    override.enable()
    yield
    override.disable()


@pytest.fixture(autouse=True)
def _fresh_throttles():
    """Throttle counters (API callers, failed credentials) live in Django's cache (Redis outside
    embedded mode, shared with the test's portal processes): every test starts with none, so one
    test's wrong tokens never turn another's 401 into a 429.  Only the cache's own keys are cleared
    (chorus_site/cache.py), never the broker's or the channel layer's."""
    from django.core.cache import cache

    cache.clear()
    yield


def role_group(name: str) -> Group:
    """The role group made by the data migration (recreated if a transactional test flushed it)."""
    try:
        return Group.objects.get(name=name)
    except Group.DoesNotExist:
        permissions.roles_sync()
        return Group.objects.get(name=name)


def _persona(fixture_name: str):
    username, role = PERSONAS[fixture_name]
    groups = [role_group(role)] if role else []
    return factories.make_user(username=username, groups=groups, is_staff=True, password=PASSWORD)


@pytest.fixture
def outsider(db):
    """Staff user without any ops role: sees nothing of sessions/executions."""
    return _persona("outsider")


@pytest.fixture
def viewer(db):
    return _persona("viewer")


@pytest.fixture
def operator(db):
    return _persona("operator")


@pytest.fixture
def diagnostics_reader(db):
    return _persona("diagnostics_reader")


@pytest.fixture
def ops_admin_user(db):
    return _persona("ops_admin_user")


@pytest.fixture
def personas(outsider, viewer, operator, diagnostics_reader, ops_admin_user):
    """name -> user for all five personas, for tests parametrised across roles."""
    return {
        "outsider": outsider,
        "viewer": viewer,
        "operator": operator,
        "diagnostics_reader": diagnostics_reader,
        "ops_admin_user": ops_admin_user,
    }


@pytest.fixture
def persona_password():
    return PASSWORD
