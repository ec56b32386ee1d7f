"""Celery: the periodic scan and the delivery of each notification, with retries."""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings
from django.utils import timezone

log = logging.getLogger(__name__)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def notifications_scan() -> dict:
    from .rules import notifications_scan as scan

    return scan()


@shared_task(acks_late=True, reject_on_worker_lost=True)
def notifications_scan_now() -> dict:
    """The scan, queued after a notifiable event commits (notifications/hooks.py).  A task of its
    own: the beat's ``notifications_scan`` claims its period (chorus_site/periodic.py), so a kick
    under that name would be skipped whenever the beat had just run."""
    from .rules import notifications_scan as scan

    return scan()


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def notification_deliver(self, delivery_id: int) -> str:
    """Send one delivery; on failure retry with backoff up to CHORUS_NOTIFY_RETRIES times, then log
    it ``failed`` with the reason.  Safe to run twice: a delivery no longer pending is left alone."""
    from .delivery import DeliveryFailed, send
    from .models import NotificationDelivery

    delivery = NotificationDelivery.objects.select_related("rule").filter(pk=delivery_id).first()
    if delivery is None or delivery.state != NotificationDelivery.PENDING:
        return "skipped"
    attempts = delivery.attempts + 1
    try:
        send(delivery)
    except DeliveryFailed as exc:
        retries = settings.CHORUS_NOTIFY_RETRIES
        if self.request.retries < retries:
            countdown = retry_countdown(self.request.retries)
            NotificationDelivery.objects.filter(pk=delivery.pk, state=NotificationDelivery.PENDING).update(
                attempts=attempts, reason=f"attempt {attempts} failed: {exc}; retrying in {countdown} s")
            raise self.retry(countdown=countdown) from None
        NotificationDelivery.objects.filter(pk=delivery.pk, state=NotificationDelivery.PENDING).update(
            attempts=attempts, state=NotificationDelivery.FAILED, finished_at=timezone.now(),
            reason=f"failed after {attempts} attempts: {exc}")
        log.warning("notification %s (%s) failed after %d attempts: %s", delivery.pk, delivery.channel, attempts, exc)
        return "failed"
    NotificationDelivery.objects.filter(pk=delivery.pk, state=NotificationDelivery.PENDING).update(
        attempts=attempts, state=NotificationDelivery.SENT, finished_at=timezone.now(), reason="")
    return "sent"


def retry_countdown(retries_done: int) -> int:
    """Seconds before the next attempt: CHORUS_NOTIFY_RETRY_S, then twice that, and so on."""
    return settings.CHORUS_NOTIFY_RETRY_S * 2 ** retries_done
