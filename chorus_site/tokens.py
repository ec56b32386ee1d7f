"""API tokens: ``cho_<prefix>_<secret>``, stored as a SHA-256 of the secret, expiring and revocable."""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.utils import timezone

from .models import ApiToken
from .permissions import permissions_preload

TOKEN_PREFIX = "cho"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def token_create(*, user, name: str = "api", expires_in_days: int | None = None) -> tuple[ApiToken, str]:
    """Create a token; the plain value is returned once and never stored."""
    prefix = secrets.token_hex(4)
    secret = secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=prefix,
        secret_hash=_hash(secret),
        expires_at=timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None,
    )
    return token, f"{TOKEN_PREFIX}_{prefix}_{secret}"


def token_authenticate(raw: str):
    """The user of a valid token, or None (wrong, expired, revoked or inactive user)."""
    parts = (raw or "").strip().split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        return None
    found = _token_and_user(parts[1])
    if found is None:
        return None
    token, user = found
    if token.revoked or not user.is_active:
        return None
    if not hmac.compare_digest(token.secret_hash, _hash(parts[2])):
        return None
    now = timezone.now()
    if token.expires_at and token.expires_at <= now:
        return None
    if token.last_used_at is None or now - token.last_used_at > timedelta(minutes=1):
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return user


def _token_and_user(prefix: str):
    """(token, user) of a token prefix, or None. On PostgreSQL one statement also brings the user's
    permissions (issue 9: the lookup was 18 % of an API list request, building the ORM query of the
    joined permissions most of it); it is written once, as SQL, and run with the prefix only."""
    if connection.vendor != "postgresql":
        token = ApiToken.objects.select_related("user").filter(prefix=prefix).first()
        return (token, token.user) if token is not None else None
    users = list(get_user_model().objects.raw(_token_sql(), [prefix]))
    if not users:
        return None
    user = users[0]
    token = ApiToken(id=user.token_id, user=user, prefix=prefix, secret_hash=user.token_secret_hash,
                     expires_at=user.token_expires_at, last_used_at=user.token_last_used_at,
                     revoked=user.token_revoked)
    permissions_preload(user, user.token_permissions)
    return token, user


@functools.cache
def _token_sql() -> str:
    User = get_user_model()
    user_perms = User.user_permissions.through._meta.db_table
    user_groups = User.groups.through._meta.db_table
    group_perms = Group.permissions.through._meta.db_table
    return f"""
        SELECT u.*, t.id AS token_id, t.secret_hash AS token_secret_hash, t.expires_at AS token_expires_at,
               t.last_used_at AS token_last_used_at, t.revoked AS token_revoked,
               ARRAY(SELECT DISTINCT ct.app_label || '.' || p.codename
                       FROM {Permission._meta.db_table} p
                       JOIN {ContentType._meta.db_table} ct ON ct.id = p.content_type_id
                      WHERE p.id IN (SELECT permission_id FROM {user_perms} WHERE user_id = u.id
                                     UNION ALL
                                     SELECT gp.permission_id FROM {group_perms} gp
                                       JOIN {user_groups} ug ON ug.group_id = gp.group_id
                                      WHERE ug.user_id = u.id)) AS token_permissions
          FROM {ApiToken._meta.db_table} t JOIN {User._meta.db_table} u ON u.id = t.user_id
         WHERE t.prefix = %s
    """


def token_revoke(*, prefix: str) -> bool:
    return ApiToken.objects.filter(prefix=prefix, revoked=False).update(revoked=True) == 1
