"""FilterSets behind the list query parameters; the admin and the API filter the same way."""

import django_filters
from django.db.models import Q

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
        return queryset.filter(Q(title__icontains=value) | Q(idea_key__icontains=value) | Q(cwd__icontains=value))


class TurnFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=states.choices(states.TURN_STATUSES))
    interrupted_reason = django_filters.ChoiceFilter(choices=states.choices(states.INTERRUPTED_REASONS))
    trigger = django_filters.ChoiceFilter(choices=states.choices(states.TRIGGERS))

    class Meta:
        model = Turn
        fields = ["status", "interrupted_reason", "trigger"]
