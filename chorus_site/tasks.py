"""Periodic housekeeping of the cross-cutting records."""

import logging

from celery import shared_task

from .events import events_purge_expired as _purge_events
from .idempotency import idempotency_purge_expired

log = logging.getLogger(__name__)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def events_purge_expired() -> int:
    """Delete events past CHORUS_EVENT_RETENTION_DAYS (safe to run twice or concurrently)."""
    deleted = _purge_events()
    idempotency_purge_expired()
    if deleted:
        log.info("purged %d events past retention", deleted)
    return deleted
