"""FilterSets behind the executions list query parameters."""

import django_filters
from django.db.models import Q

from sessions_app.states import choices

from . import states
from .models import Artifact, Attempt, Issue, Run


class IssueFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=choices(states.ISSUE_STATES))
    completion_policy = django_filters.ChoiceFilter(choices=choices(states.COMPLETION_POLICIES))
    q = django_filters.CharFilter(method="search")

    class Meta:
        model = Issue
        fields = ["status", "completion_policy"]

    def search(self, queryset, name, value):
        return queryset.filter(Q(title__icontains=value) | Q(body__icontains=value))


class RunFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=choices(states.RUN_STATES))
    mode = django_filters.ChoiceFilter(choices=choices(states.RUN_MODES))
    issue = django_filters.UUIDFilter(field_name="issue_id")
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")
    q = django_filters.CharFilter(method="search")

    class Meta:
        model = Run
        fields = ["state", "mode", "issue"]

    def search(self, queryset, name, value):
        return queryset.filter(Q(issue__title__icontains=value) | Q(failure_message__icontains=value))


class AttemptFilter(django_filters.FilterSet):
    task = django_filters.UUIDFilter(field_name="task_id")
    state = django_filters.ChoiceFilter(choices=choices(states.ATTEMPT_STATES))
    connection = django_filters.UUIDFilter(field_name="connection_id")

    class Meta:
        model = Attempt
        fields = ["task", "state", "connection"]


class ArtifactFilter(django_filters.FilterSet):
    issue = django_filters.UUIDFilter(field_name="issue_id")
    run = django_filters.UUIDFilter(field_name="run_id")
    attempt = django_filters.UUIDFilter(field_name="attempt_id")
    kind = django_filters.ChoiceFilter(choices=choices(states.ARTIFACT_KINDS))

    class Meta:
        model = Artifact
        fields = ["issue", "run", "attempt", "kind"]
