"""API tokens: ``cho_<prefix>_<secret>``, stored as a SHA-256 of the secret, expiring and revocable."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from django.utils import timezone

from .models import ApiToken

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
    token = ApiToken.objects.select_related("user").filter(prefix=parts[1]).first()
    if token is None or token.revoked or not token.user.is_active:
        return None
    if not hmac.compare_digest(token.secret_hash, _hash(parts[2])):
        return None
    now = timezone.now()
    if token.expires_at and token.expires_at <= now:
        return None
    if token.last_used_at is None or now - token.last_used_at > timedelta(minutes=1):
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user


def token_revoke(*, prefix: str) -> bool:
    return ApiToken.objects.filter(prefix=prefix, revoked=False).update(revoked=True) == 1
