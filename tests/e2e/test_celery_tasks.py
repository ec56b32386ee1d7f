"""Background work runs on a real Celery worker (Redis broker)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from chorus_site.events import event_append
from chorus_site.models import Event, EventStream
from chorus_site import periodic
from chorus_site.tasks import events_purge_expired
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_retention_purge_runs_on_the_worker(celery_worker_process, settings):
    old = [event_append(stream="connection:00000000-0000-0000-0000-000000000001", kind="test.old") for _ in range(3)]
    fresh = event_append(stream="connection:00000000-0000-0000-0000-000000000001", kind="test.fresh")
    Event.objects.filter(pk__in=[e.pk for e in old]).update(
        at=timezone.now() - timedelta(days=settings.CHORUS_EVENT_RETENTION_DAYS + 1))

    # A worker runs a scheduled job once per period (chorus_site/periodic.py): a purge claimed by an
    # earlier run on this Redis (another test's beat, or the previous suite within the hour) would
    # skip this one, so the period starts unclaimed here.
    periodic._client().delete(periodic.claim_key(events_purge_expired.name))
    events_purge_expired.apply_async(queue=celery_worker_process)

    wait_until(lambda: not Event.objects.filter(pk__in=[e.pk for e in old]).exists(), timeout=30,
               message="the worker to purge expired events")
    assert Event.objects.filter(pk=fresh.pk).exists()
    stream = EventStream.objects.get(name="connection:00000000-0000-0000-0000-000000000001")
    assert stream.purged_through_id == old[-1].pk
