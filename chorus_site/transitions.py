"""One mechanism for every state machine: a conditional UPDATE plus an event, in one transaction.

Each app declares its tables in ``states.py`` as ``{from_state: {to_state, ...}}`` and its
transition services call :func:`transition`.  Anything the table does not allow (including
repeating the current state) is refused with 409 ``invalid_transition``; a lost race is refused
the same way, because the UPDATE's ``WHERE state IN (...)`` no longer matches.

Lock order (STYLE.md; the one place it is written down)
--------------------------------------------------------
Every transaction takes its row locks in this order::

    run rows:      parent run → run → node → task → attempt (and approval) → issue
    then sessions: connection → session → turn → control command
    last:          event stream counters (``event_append`` locks its stream's row until commit)

The run lock is what makes this hold in practice: a transaction that holds it may touch that
run's rows (and, after them, sessions' rows and streams) as its logic needs, because every other
transaction that could want them waits for the run lock first, holding nothing yet that is later
in the order.

* **The run row lock first.** Every writer of a run's nodes, tasks, attempts, approvals, comments
  and artifacts, and of its event stream, takes the run's row lock before anything else of that
  run: ``executions.services.run_lock`` does it inside each service (the tick, ``task_retry``, the
  agents' talk-back, operator actions alike), so those transactions are serialised per run and the
  order of node/task/attempt rows below the run lock cannot deadlock.  A subrun's ancestors are
  locked before it (a child finishing updates its parent's node; cancelling a parent reaches its
  children).
* **Executions before sessions.** The engine enqueues turns while it holds the run lock;
  sessions_app never takes an executions lock (it learns of turns' ends through listeners that run
  after commit), so no session-side transaction ever waits for a run-side row.
* **Session before turn.** Every change of a turn locks its session row first (``turn_create``,
  ``turn_set_status``, ``turn_set_stop_state``, ``services.turn_lock`` for actions and reports that
  decide on a turn).  The connection row is never locked by a session-side change.
* **FOR NO KEY UPDATE, never FOR UPDATE.** PostgreSQL checks a foreign key at COMMIT (Django's
  constraints are deferred) with ``FOR KEY SHARE`` on the referenced row: that conflicts with
  ``FOR UPDATE``, so a transaction that inserted an artifact (stream locked, then the FK check on
  its run) deadlocked against a tick holding the run ``FOR UPDATE`` and waiting for the stream.
  No code here changes a key or deletes under a lock, so every lock is
  ``select_for_update(no_key=True)`` (plain UPDATEs take that mode too), which FK checks never wait for.

``tests/executions/test_races.py`` and ``tests/sessions_app/test_races.py`` run the pairs that
used to deadlock concurrently on PostgreSQL.
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
        row = model.objects.select_for_update(no_key=True).filter(pk=pk).values(field).first()
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
