"""What needs an operator (issue 11): the querysets behind the dashboard's needs-attention counts
and the changelist filter each count links to, so both always show the same rows.

Each one reads through an index that keeps it cheap at any table size: active turns are few (the
(status, id) index), failures are read through the (interrupted_reason, id) index.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.contrib import admin
from django.db.models import Q, QuerySet
from django.utils import timezone

from . import states
from .models import Connection, Turn
from .selectors import heartbeat_timeout

# A turn "failed" when something other than an operator or a shutdown interrupted it.
FAILED_REASONS = (states.REASON_CRASH, states.REASON_TIMEOUT, states.REASON_INVALID_PATH, states.REASON_OFFLINE)
RECENT = timedelta(hours=24)


def turns_stuck_or_stalled(now: datetime | None = None) -> QuerySet:
    """Running turns flagged stalled (nothing came from the agent for its threshold: stalls.py), and
    active turns whose connection is not live (offline, or its heartbeat is stale): the §4.2 case an
    operator clears."""
    stale = (now or timezone.now()) - heartbeat_timeout()
    not_live = (~Q(connection__status=states.CONN_ONLINE) | Q(connection__last_heartbeat_at__lt=stale)
                | Q(connection__last_heartbeat_at__isnull=True))
    stalled = Q(status=states.RUNNING, stalled_at__isnull=False)
    return Turn.objects.filter(status__in=[states.RUNNING, states.REQUIRES_ACTION]).filter(
        stalled | (Q(connection__isnull=False) & not_live))


def turns_failed_since(since: datetime) -> QuerySet:
    return Turn.objects.filter(status=states.INTERRUPTED, interrupted_reason__in=FAILED_REASONS,
                               ended_at__gte=since)


def turns_stop_unconfirmed() -> QuerySet:
    """Stops the portal could not confirm: the agent's process may still be alive on its host."""
    return Turn.objects.filter(stop_state=states.STOP_UNCONFIRMED)


def turns_waiting_for_answer() -> QuerySet:
    return Turn.objects.filter(status=states.REQUIRES_ACTION)


def connections_down() -> QuerySet:
    return Connection.objects.filter(status__in=[states.CONN_OFFLINE, states.CONN_DRAINING])


TURN_ATTENTION = {
    "stuck": ("stuck or stalled", lambda now: turns_stuck_or_stalled(now)),
    "failed_24h": ("failed in the last 24 h", lambda now: turns_failed_since(now - RECENT)),
    "stop_unconfirmed": ("stop unconfirmed", lambda now: turns_stop_unconfirmed()),
    "waiting": ("waiting for an answer", lambda now: turns_waiting_for_answer()),
}


class TurnAttentionFilter(admin.SimpleListFilter):
    """The turn changelist's side of the dashboard: ``?attention=<key>`` lists what a count counted."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request, model_admin):
        return [(key, label) for key, (label, _) in TURN_ATTENTION.items()]

    def queryset(self, request, queryset):
        if self.value() not in TURN_ATTENTION:
            return queryset
        return queryset & TURN_ATTENTION[self.value()][1](timezone.now())
