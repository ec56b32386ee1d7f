"""Idempotency-Key handling (SPEC §8).

The record is inserted in the same transaction as the action it guards.  A concurrent duplicate
blocks on the unique index until the first commits, then finds the finished record and replays
it; if the first rolled back, the duplicate acts instead.  Either way the action happens once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from .errors import ApplicationError
from .models import IdempotencyRecord

Answer = tuple[int, dict]


def request_hash(body) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def validate_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable():
        raise ApplicationError("bad_request", "Idempotency-Key must be 1–255 printable characters")
    return key


def _ttl_cutoff():
    return timezone.now() - timedelta(hours=settings.CHORUS_IDEMPOTENCY_TTL_HOURS)


def idempotent_call(
    *, user, route: str, key: str | None, body, action: Callable[[], Answer], scope: str | None = None,
) -> tuple[int, dict, bool]:
    """Run ``action`` once per (scope, route, key); returns (status, body, replayed).

    The scope defaults to the user ("user:<id>", or "anonymous"); daemon reports pass
    "connection:<id>".
    """
    key = validate_key(key)
    if key is None:
        status, answer = _run(action)
        return status, answer, False
    digest = request_hash(body)
    user_id = getattr(user, "pk", None)
    scope = scope or (f"user:{user_id}" if user_id is not None else "anonymous")
    IdempotencyRecord.objects.filter(scope=scope, route=route, key=key, created_at__lt=_ttl_cutoff()).delete()
    try:
        with transaction.atomic():
            record = IdempotencyRecord.objects.create(scope=scope, user_id=user_id, route=route, key=key,
                                                      request_hash=digest)
            status, answer = _run(action)
            IdempotencyRecord.objects.filter(pk=record.pk).update(
                state=IdempotencyRecord.STATE_DONE, response_status=status, response_body=answer
            )
            return status, answer, False
    except IntegrityError:
        pass
    record = IdempotencyRecord.objects.filter(scope=scope, route=route, key=key).first()
    if record is None or record.state != IdempotencyRecord.STATE_DONE:
        raise ApplicationError("idempotency_in_progress", "a request with this Idempotency-Key is still running; retry shortly")
    if record.request_hash != digest:
        raise ApplicationError(
            "idempotency_mismatch", "this Idempotency-Key was used with a different request body", {"key": key}
        )
    return record.response_status, record.response_body, True


def _run(action: Callable[[], Answer]) -> Answer:
    """Refusals are answers too: they are recorded and replayed like successes."""
    try:
        with transaction.atomic():
            return action()
    except ApplicationError as error:
        return error.status, error.as_body()


def idempotency_purge_expired() -> int:
    return IdempotencyRecord.objects.filter(created_at__lt=_ttl_cutoff()).delete()[0]
