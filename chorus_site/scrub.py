"""Secrets stored before they were kept off storage are scrubbed (issue 8 items 1 and 5).

Since then the attempt's task token travels to the daemon on the wire only (derived again at
delivery, ``executions.task_tokens.attempt_env``) and an idempotency record never keeps the
one-time key it answered with (``idempotency.withhold_secrets``).  Rows written earlier still hold
them in clear: a ``ControlCommand.payload.env.CHORUS_TASK_TOKEN`` and a ``response_body.key`` of a
connection registration.  ``stored_secrets_scrub`` removes them; it runs after every ``migrate``
(``post_migrate``, so an upgrade cannot skip it, and a second run finds nothing) and as
``manage.py chorus_scrub_secrets``.
"""

from __future__ import annotations

import json

from django.db import transaction
from django.db.models import Q, TextField
from django.db.models.functions import Cast

from .idempotency import withhold_secrets
from .redaction import redact_data

TASK_TOKEN_ENV = "CHORUS_TASK_TOKEN"
# Credential formats of our own that a stored answer or payload must not hold in clear.
CREDENTIAL_MARKS = ("cht_", "chk_", "cho_")
# Routes whose answers carry a one-time secret, and its fields (as the routes declare them).
SECRET_ANSWERS = {"connections.register": ("key",)}
BATCH = 500


def _holding_credentials(queryset, *fields):
    condition = Q()
    for field in fields:
        text = f"_{field}_text"
        queryset = queryset.annotate(**{text: Cast(field, TextField())})
        for mark in CREDENTIAL_MARKS:
            condition |= Q(**{f"{text}__contains": mark})
    return queryset.filter(condition)


def _holds_mark(value) -> bool:
    return any(mark in json.dumps(value, default=str) for mark in CREDENTIAL_MARKS)


def _command_scrubbed(payload, result):
    """Without the task token; redacted only if a credential is still there (a prompt stays as it was)."""
    payload = dict(payload or {})
    if isinstance(payload.get("env"), dict):
        payload["env"] = {k: v for k, v in payload["env"].items() if k != TASK_TOKEN_ENV}
    return (redact_data(payload) if _holds_mark(payload) else payload,
            redact_data(result) if _holds_mark(result) else result)


def stored_secrets_scrub(*, ControlCommand=None, IdempotencyRecord=None) -> dict[str, int]:
    """Scrub stored task tokens and one-time keys; returns how many rows of each were changed."""
    if ControlCommand is None:
        from sessions_app.models import ControlCommand
    if IdempotencyRecord is None:
        from .models import IdempotencyRecord
    counts = {"commands": 0, "idempotency_records": 0}
    commands = ControlCommand.objects.filter(Q(payload__env__has_key=TASK_TOKEN_ENV)
                                             | Q(pk__in=_holding_credentials(ControlCommand.objects, "payload",
                                                                             "result").values("pk")))
    for pk in list(commands.values_list("pk", flat=True)):
        with transaction.atomic():
            row = ControlCommand.objects.select_for_update(no_key=True).filter(pk=pk).values("payload", "result").first()
            if row is None:
                continue
            payload, result = _command_scrubbed(row["payload"], row["result"])
            if (payload, result) != (row["payload"], row["result"]):
                ControlCommand.objects.filter(pk=pk).update(payload=payload, result=result)
                counts["commands"] += 1
    records = _holding_credentials(IdempotencyRecord.objects, "response_body")
    for pk, route, body in list(records.values_list("pk", "route", "response_body")):
        scrubbed = redact_data(withhold_secrets(body, SECRET_ANSWERS.get(route, ())))
        if scrubbed != body:
            IdempotencyRecord.objects.filter(pk=pk).update(response_body=scrubbed)
            counts["idempotency_records"] += 1
    return counts


def scrub_after_migrate(sender, apps=None, using="default", **kwargs):
    """post_migrate: scrub with the migrated models (``flush`` sends no ``apps``: the installed ones)."""
    if apps is None:
        from django.apps import apps
    try:
        ControlCommand = apps.get_model("sessions_app", "ControlCommand")
        IdempotencyRecord = apps.get_model("chorus_site", "IdempotencyRecord")
    except LookupError:
        return
    stored_secrets_scrub(ControlCommand=ControlCommand, IdempotencyRecord=IdempotencyRecord)
