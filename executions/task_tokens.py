"""Task tokens: what an attempt's agent process uses to talk back (SPEC §5).

A token is signed (no table), names one attempt, and stops working when that attempt has been
finished for a while or after TASK_TOKEN_MAX_AGE.  Only the attempt's own records can be touched.
"""

from __future__ import annotations

from datetime import timedelta

from django.core import signing
from django.utils import timezone

from .models import Attempt

PREFIX = "cht_"
SALT = "chorus.task-token"
TASK_TOKEN_MAX_AGE = timedelta(hours=24)
GRACE_AFTER_END = timedelta(minutes=5)


def task_token_for(attempt: Attempt) -> str:
    return PREFIX + signing.dumps({"attempt": str(attempt.pk)}, salt=SALT, compress=True)


def attempt_for_task_token(raw: str | None) -> Attempt | None:
    if not raw or not raw.startswith(PREFIX):
        return None
    try:
        data = signing.loads(raw[len(PREFIX):], salt=SALT, max_age=TASK_TOKEN_MAX_AGE)
    except signing.BadSignature:
        return None
    attempt = Attempt.objects.select_related("task__node__run").filter(pk=data.get("attempt")).first()
    if attempt is None:
        return None
    if attempt.ended_at and timezone.now() - attempt.ended_at > GRACE_AFTER_END:
        return None
    return attempt


def attempt_env(turn) -> dict:
    """The environment of an attempt's agent: its ids and its task token (registered at app start)."""
    if not turn.attempt_id:
        return {}
    attempt = Attempt.objects.select_related("task__node__run").filter(pk=turn.attempt_id).first()
    if attempt is None:
        return {}
    run = attempt.task.node.run
    return {"CHORUS_TASK_TOKEN": task_token_for(attempt), "CHORUS_ATTEMPT_ID": str(attempt.pk),
            "CHORUS_RUN_ID": str(run.pk), "CHORUS_ISSUE_ID": str(run.issue_id),
            "CHORUS_TASK_ID": str(attempt.task_id)}
