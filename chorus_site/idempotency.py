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


WITHHELD_MESSAGE = ("already created; the secret was shown once, in the first answer, and is not kept: "
                    "rotate it to get a new one")


def withhold_secrets(answer, secret_fields: tuple[str, ...]):
    """The answer as it may be stored and replayed: each of ``secret_fields`` set to None.

    ``secret_fields`` of an answer (a one-time key) reach the first caller only: the record
    keeps, and a replay answers, the rest with this note (SPEC §8, §7).
    """
    if not secret_fields or not isinstance(answer, dict) or not any(answer.get(f) for f in secret_fields):
        return answer
    withheld = sorted(f for f in secret_fields if answer.get(f))
    return {**answer, **{f: None for f in withheld}, "withheld": withheld, "message": WITHHELD_MESSAGE}


def idempotent_call(
    *, user, route: str, key: str | None, body, action: Callable[[], Answer], scope: str | None = None,
    secret_fields: tuple[str, ...] = (),
    record_refusals: bool = True,
) -> tuple[int, dict, bool]:
    """Run ``action`` once per (scope, route, key); returns (status, body, replayed).

    The scope defaults to the user ("user:<id>", or "anonymous"); daemon reports pass
    "connection:<id>".  With ``record_refusals=False`` a refusal (status >= 400) is not kept: the
    same key asks again later and is decided on the state then (a daemon retries a refused report,
    e.g. once its snapshot has reconciled the turn); only an applied answer is replayed.
    """
    key = validate_key(key)
    if key is None:
        status, answer = _run(action)
        return status, answer, False
    digest = request_hash(body)
    user_id = getattr(user, "pk", None)
    scope = scope or (f"user:{user_id}" if user_id is not None else "anonymous")
    IdempotencyRecord.objects.filter(scope=scope, route=route, key=key, created_at__lt=_ttl_cutoff()).delete()
    with transaction.atomic():
        # The savepoint guards the record insert only: an IntegrityError of the action itself is the
        # action's error and surfaces as such, never as "a request with this key is in progress".
        try:
            with transaction.atomic():
                record = IdempotencyRecord.objects.create(scope=scope, user_id=user_id, route=route, key=key,
                                                          request_hash=digest)
        except IntegrityError:
            record = None
        if record is not None:
            status, answer = _run(action)
            if status >= 400 and not record_refusals:
                record.delete()  # the caller retries a refusal and wants it decided again, not replayed
            else:
                IdempotencyRecord.objects.filter(pk=record.pk).update(
                    state=IdempotencyRecord.STATE_DONE, response_status=status,
                    response_body=withhold_secrets(answer, secret_fields),
                )
            return status, answer, False
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
