"""FilterSets behind the list query parameters; the admin and the API filter the same way."""

import django_filters
from django.db.models import Q

from chorus_site.search import as_uuid, contains_any

from . import states
from .models import Connection, Session, Turn


class ConnectionFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=states.choices([states.CONN_ONLINE, states.CONN_OFFLINE,
                                                                  states.CONN_DRAINING]))
    backend = django_filters.ChoiceFilter(choices=states.choices(states.BACKENDS))
    host = django_filters.CharFilter()

    class Meta:
        model = Connection
        fields = ["status", "backend", "host"]


class SessionFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=states.choices([states.SESSION_ACTIVE, states.SESSION_ENDED]))
    backend = django_filters.ChoiceFilter(choices=states.choices(states.BACKENDS))
    connection = django_filters.UUIDFilter(field_name="connection_id")
    cwd = django_filters.CharFilter()
    idea_key = django_filters.CharFilter()
    q = django_filters.CharFilter(method="search")

    class Meta:
        model = Session
        fields = ["status", "backend", "connection", "cwd", "idea_key"]

    def search(self, queryset, name, value):
        # Indexed fields only (chorus_site/search.py): an id, an exact idea key, or a substring of
        # 3+ characters of the title, idea key or cwd (trigram indexes).
        if (session_id := as_uuid(value)) is not None:
            return queryset.filter(pk=session_id)
        return queryset.filter(Q(idea_key=value.strip()) | contains_any(value, "title", "idea_key", "cwd"))


class TurnFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=states.choices(states.TURN_STATUSES))
    interrupted_reason = django_filters.ChoiceFilter(choices=states.choices(states.INTERRUPTED_REASONS))
    trigger = django_filters.ChoiceFilter(choices=states.choices(states.TRIGGERS))
    stalled = django_filters.BooleanFilter(method="filter_stalled")

    class Meta:
        model = Turn
        fields = ["status", "interrupted_reason", "trigger", "stalled"]

    def filter_stalled(self, queryset, name, value):
        # Stalled is a flag of running turns (sessions_app/stalls.py); a cleared flag is not stalled.
        stalled = Q(status=states.RUNNING, stalled_at__isnull=False)
        return queryset.filter(stalled) if value else queryset.exclude(stalled)
