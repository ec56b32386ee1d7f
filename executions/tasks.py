"""Celery tasks of the run engine: ticks are idempotent, claim their run by row lock, safe to repeat."""

from celery import shared_task


@shared_task(acks_late=True, reject_on_worker_lost=True)
def run_tick(run_id: str) -> str:
    from .engine import run_tick_apply

    return run_tick_apply(run_id=run_id)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def runs_tick_waiting() -> int:
    """Periodic: runs that wait continue by themselves when the cause clears (host back, capacity)."""
    from .engine import run_tick_apply, runs_needing_a_tick

    run_ids = runs_needing_a_tick()
    for run_id in run_ids:
        run_tick_apply(run_id=run_id)
    return len(run_ids)
