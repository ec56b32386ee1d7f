"""One mechanism for every state machine: a conditional UPDATE plus an event, in one transaction.

Each app declares its tables in ``states.py`` as ``{from_state: {to_state, ...}}`` and its
transition services call :func:`transition`.  Anything the table does not allow (including
repeating the current state) is refused with 409 ``invalid_transition``; a lost race is refused
the same way, because the UPDATE's ``WHERE state IN (...)`` no longer matches.
"""

from __future__ import annotations

from collections.abc import Mapping

from django.db import transaction

from .errors import ApplicationError
from .events import event_append


def sources_of(table: Mapping[str, set[str]], target: str) -> list[str]:
    return sorted(src for src, targets in table.items() if target in targets)


def transition(
    *,
    model,
    pk,
    field: str,
    table: Mapping[str, set[str]],
    to: str,
    stream: str,
    kind: str,
    actor: str = "",
    updates: dict | None = None,
    data: dict | None = None,
    expected_from: set[str] | None = None,
):
    """Move ``model(pk).field`` to ``to``; returns the refreshed object.

    ``expected_from`` narrows the allowed sources further (e.g. "only from running").
    """
    allowed_from = set(sources_of(table, to))
    if expected_from is not None:
        allowed_from &= set(expected_from)
    with transaction.atomic():
        # Lock the row so the recorded "from" is the state this update replaced.
        row = model.objects.select_for_update().filter(pk=pk).values(field).first()
        if row is None:
            raise ApplicationError("not_found", f"{model._meta.verbose_name} {pk} does not exist")
        current = row[field]
        values = {field: to, **(updates or {})}
        updated = model.objects.filter(pk=pk, **{f"{field}__in": allowed_from}).update(**values)
        if updated != 1:
            raise ApplicationError(
                "invalid_transition",
                f"{model._meta.verbose_name} cannot go from {current} to {to}",
                {"from": current, "to": to, "allowed_from": sorted(allowed_from)},
            )
        event_append(
            stream=stream,
            kind=kind,
            actor=actor,
            data={"id": str(pk), field: to, "from": current, **(data or {})},
        )
        return model.objects.get(pk=pk)
