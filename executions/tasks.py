"""Celery tasks of the run engine: ticks are idempotent, claim their run by row lock, safe to repeat."""

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def run_tick(run_id: str) -> str:
    from .engine import run_tick_apply

    return run_tick_apply(run_id=run_id)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def runs_tick_waiting() -> int:
    """Periodic: every run whose rows say it needs a tick gets one (waiting runs whose cause may have
    cleared, and any tick whose message was lost).  One task per run: one failing run does not keep
    the others from theirs, and the ticks spread over the workers."""
    from django.conf import settings

    from chorus_site.scheduling import enqueue

    from .recovery import runs_needing_a_tick

    try:
        run_ids = runs_needing_a_tick()
    except Exception:
        log.exception("could not find the runs needing a tick; the next beat retries")
        return 0
    # A tick still queued when a later sweep has asked again is dropped unrun (the later one does
    # the work), so a slow or returning worker does not face every tick every sweep ever asked for.
    expires = settings.CHORUS_SWEEP_EXPIRES_S
    return sum(enqueue(run_tick, args=[run_id], expires=expires) for run_id in run_ids)
