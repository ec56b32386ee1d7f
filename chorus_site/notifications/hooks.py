"""Evaluate rules right after a notifiable event commits, not only at the next beat scan.

Every event is recorded through ``chorus_site.events`` (``Event.objects.create`` for state changes;
only agent output goes through ``bulk_create``, and output notifies nobody), so a ``post_save``
receiver on ``Event`` sees each state change as it is written.  It does no matching: a cheap look
at the kind and status decides whether the change could notify anyone, and if so one Celery task
is queued *after commit* (a change that rolls back queues nothing).  The worker runs the same
cursor scan as the beat (notifications/rules.py), which is safe to run twice at once; the beat
scan stays the catch-up for a worker or broker that was down.
"""

from __future__ import annotations

from django.conf import settings
from django.db.models.signals import post_save

from chorus_site.scheduling import enqueue_on_commit
from sessions_app import states as ss

from .rules import SCAN_KINDS

RUN_FAILED_STATES = frozenset({"failed", "partial_succeeded"})


def notifiable(kind: str, data: dict) -> bool:
    """Could this event be a happening of ``rules.happenings_of``?  (Its first test, no reads; when
    in doubt yes: an extra scan costs one indexed read.)"""
    if kind == "turn.status":
        return data.get("status") == ss.INTERRUPTED and data.get("interrupted_reason") in ss.WAKE_ERROR_REASONS
    if kind == "turn.stop_state":
        return data.get("stop_state") == ss.STOP_UNCONFIRMED
    if kind == "run.state":
        return data.get("state") in RUN_FAILED_STATES
    return kind in SCAN_KINDS  # a kind the scan reads that has no cheaper test here (turn.stalled, ...)


def event_saved(sender, instance, created, raw=False, **kwargs) -> None:
    if not created or raw or not notifiable(instance.kind, instance.data or {}):
        return
    if settings.CELERY_TASK_ALWAYS_EAGER:
        return  # embedded mode would run the scan (and send mail) inside the request: leave it to the beat
    from .tasks import notifications_scan_now

    # After commit, and a broker that does not answer is logged, never fails the committed change
    # (the beat scan finds the event).
    enqueue_on_commit(notifications_scan_now)


def connect() -> None:
    from chorus_site.models import Event

    post_save.connect(event_saved, sender=Event, dispatch_uid="notifications.event_saved")
