"""Run a Celery task later, also in embedded mode.

Embedded mode runs tasks in-process (``task_always_eager``), where a countdown would be ignored
and the task would run at once; there a daemon timer thread waits instead.
"""

from __future__ import annotations

import threading

from django.conf import settings
from django.db import transaction


def run_later(task, *, args=(), delay_s: float) -> None:
    """Enqueue ``task(*args)`` to run ``delay_s`` seconds after the current transaction commits."""

    def enqueue():
        if settings.CELERY_TASK_ALWAYS_EAGER:
            timer = threading.Timer(delay_s, task.apply, args=(tuple(args),))
            timer.daemon = True
            timer.start()
        else:
            task.apply_async(args=tuple(args), countdown=delay_s)

    transaction.on_commit(enqueue)
