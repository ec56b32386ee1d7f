"""Background work of the bridge: stop deadlines and the stale-connection sweep (Celery)."""

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def turn_stop_deadline(turn_id: str, deadline: str | None = None) -> bool:
    """Mark a stop that was never confirmed ``unconfirmed`` (safe to run twice; the sweep does it too)."""
    from .actions import turn_stop_deadline_check

    return turn_stop_deadline_check(turn_id=turn_id, deadline=deadline)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def connections_sweep() -> dict:
    """Connections whose heartbeat is stale go offline and their turns settle ``offline``; stops past
    their deadline are marked ``unconfirmed`` (a deadline message may have been lost)."""
    from .actions import stops_settle_overdue
    from .bridge import connections_sweep_stale

    result = {}
    # Each part on its own: one failing must not keep the other from running.
    try:
        result.update(connections_sweep_stale())
    except Exception:
        log.exception("stale-connection sweep failed; the next beat retries")
    try:
        result["stops_unconfirmed"] = stops_settle_overdue()
    except Exception:
        log.exception("overdue-stop sweep failed; the next beat retries")
    return result


@shared_task(acks_late=True, reject_on_worker_lost=True)
def turns_stall_sweep() -> dict:
    """Flag running turns silent past their threshold stalled, and clear flags that no longer hold."""
    from .stalls import turns_sweep_stalled

    return turns_sweep_stalled()
