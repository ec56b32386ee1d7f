"""Enqueue Celery tasks after commit; a message is a wake-up, the database is the truth.

Commit first, then enqueue: a broker that is down (or a worker that is killed holding the
message) loses the wake-up only.  Every task enqueued here has a database-derived twin in the
periodic sweeps (``sessions_app.tasks.connections_sweep``: overdue stops, pending turns of gone
connections; ``executions.tasks.runs_tick_waiting``: runs whose state says they need a tick), so
an enqueue that fails is logged and left to the sweep, and the caller answers with what it
committed instead of a 500.

Embedded mode runs tasks in-process (``task_always_eager``), where a countdown would be ignored
and the task would run at once; there a daemon timer thread waits instead.
"""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)


def enqueue(task, *, args=(), countdown: float | None = None, expires: float | None = None) -> bool:
    """Send ``task(*args)`` now; False (logged) if the broker refused — the sweep recovers it.

    ``expires``: a message still queued that many seconds later is dropped by the worker unrun.
    """
    try:
        if countdown and settings.CELERY_TASK_ALWAYS_EAGER:
            timer = threading.Timer(countdown, _apply_logged, args=(task, tuple(args)))
            timer.daemon = True
            timer.start()
        elif settings.CELERY_TASK_ALWAYS_EAGER:
            _apply_logged(task, tuple(args))
        else:
            task.apply_async(args=tuple(args), countdown=countdown, expires=expires)
    except Exception:  # broker down, connection reset: the committed state is recovered by the sweep
        log.warning("could not enqueue %s%r; the periodic sweep recovers it from the database", task.name,
                    tuple(args), exc_info=True)
        return False
    return True


def _apply_logged(task, args: tuple) -> None:
    # Eager (embedded) mode runs the task here: its failure must not fail the change that enqueued it.
    try:
        task.apply(args=args, throw=True)
    except Exception:
        log.exception("task %s%r failed; the periodic sweep retries it", task.name, args)


def enqueue_on_commit(task, *, args=(), countdown: float | None = None) -> None:
    """Enqueue ``task(*args)`` once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: enqueue(task, args=args, countdown=countdown))


def run_later(task, *, args=(), delay_s: float) -> None:
    """Enqueue ``task(*args)`` to run ``delay_s`` seconds after the current transaction commits.

    Delays beyond ``CHORUS_ETA_MAX_S`` are not enqueued: the broker would hold (and, past its
    visibility timeout, redeliver) the message for that long; the periodic sweep finds the
    deadline in the database instead.
    """
    if delay_s > settings.CHORUS_ETA_MAX_S:
        return
    enqueue_on_commit(task, args=args, countdown=delay_s)
