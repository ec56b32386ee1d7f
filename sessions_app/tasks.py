"""Background work of the bridge: stop deadlines and the stale-connection sweep (Celery)."""

from celery import shared_task


@shared_task(acks_late=True, reject_on_worker_lost=True)
def turn_stop_deadline(turn_id: str) -> bool:
    """Mark a stop that was never confirmed ``unconfirmed`` (safe to run twice)."""
    from .actions import turn_stop_deadline_check

    return turn_stop_deadline_check(turn_id=turn_id)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def connections_sweep() -> dict:
    """Connections whose heartbeat is stale go offline; their active turns settle ``offline``."""
    from .bridge import connections_sweep_stale

    return connections_sweep_stale()
