"""Is an open stream's holder still allowed? (SPEC §7, §10; issue 8 item 6)

A WebSocket or SSE stream is authorised once, when it opens, and may then stay open for hours.
Its holder can lose access meanwhile: the role is removed, the user is deactivated, the login
session is deleted (logout, password change) or the API token is revoked.  Open streams ask
this module every ``CHORUS_ACCESS_RECHECK_S`` seconds and close when the answer is no.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from types import SimpleNamespace

from django.conf import settings
from django.contrib import auth

from .permissions import has_ops_role
from .tokens import token_authenticate


@dataclass(frozen=True)
class Grant:
    """How a stream was authorised: a user, and the login session or API token that proved it."""

    user_id: int
    session_key: str | None = None
    token: str | None = None


def recheck_interval() -> float:
    return float(settings.CHORUS_ACCESS_RECHECK_S)


def grant_still_valid(grant: Grant) -> bool:
    """True while the credential still authenticates the same, active user with an ops role."""
    if grant.token is not None:
        user = token_authenticate(grant.token)
    elif grant.session_key is not None:
        engine = import_module(settings.SESSION_ENGINE)
        session = engine.SessionStore(session_key=grant.session_key)
        if not session.exists(grant.session_key):
            return False
        # auth.get_user checks the backend, is_active and the session hash (a password change ends it).
        user = auth.get_user(SimpleNamespace(session=session))
    else:
        user = auth.get_user_model().objects.filter(pk=grant.user_id, is_active=True).first()
    if user is None or not user.is_authenticated or user.pk != grant.user_id or not user.is_active:
        return False
    return has_ops_role(user)
