"""FilterSets behind the executions list query parameters."""

from datetime import timezone as dt_timezone

import django_filters
from django.db.models import Q

from chorus_site.errors import ApplicationError
from chorus_site.search import as_uuid, contains_any
from sessions_app.states import choices

from . import states
from .models import Artifact, Attempt, Issue, Run


# A runs search by issue title looks at the runs of at most this many matching issues.
SEARCH_MAX_ISSUES = 1000


class IssueFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=choices(states.ISSUE_STATES))
    completion_policy = django_filters.ChoiceFilter(choices=choices(states.COMPLETION_POLICIES))
    q = django_filters.CharFilter(method="search")

    class Meta:
        model = Issue
        fields = ["status", "completion_policy"]

    def search(self, queryset, name, value):
        # Indexed fields only (chorus_site/search.py): an id, or a substring of the title or body.
        if (issue_id := as_uuid(value)) is not None:
            return queryset.filter(pk=issue_id)
        return queryset.filter(contains_any(value, "title", "body"))


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    """An ISO 8601 date-time, compared in UTC.

    ISO 8601 allows offsets PostgreSQL does not (it takes up to ±15:59): ``…-17:34`` was a 500.
    In UTC every offset is fine; a time that has no UTC value (year 1 minus an offset) is a 400.
    """

    def filter(self, qs, value):
        if value is not None:
            try:
                value = value.astimezone(dt_timezone.utc)
            except (OverflowError, ValueError):
                raise ApplicationError("bad_request", f"{self.field_name}: date-time out of range") from None
        return super().filter(qs, value)


class RunFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=choices(states.RUN_STATES))
    mode = django_filters.ChoiceFilter(choices=choices(states.RUN_MODES))
    issue = django_filters.UUIDFilter(field_name="issue_id")
    created_after = UtcDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = UtcDateTimeFilter(field_name="created_at", lookup_expr="lt")
    q = django_filters.CharFilter(method="search")

    class Meta:
        model = Run
        fields = ["state", "mode", "issue"]

    def search(self, queryset, name, value):
        # Indexed fields only (chorus_site/search.py): a run's or its issue's id, or a substring of
        # its issue's title or its failure message. The issues are found first (their own trigram
        # index): an OR across the join could use no index and read every run.
        if (some_id := as_uuid(value)) is not None:
            return queryset.filter(Q(pk=some_id) | Q(issue_id=some_id))
        issue_ids = list(Issue.objects.filter(contains_any(value, "title")).values_list("id", flat=True)
                         [:SEARCH_MAX_ISSUES])
        return queryset.filter(Q(issue_id__in=issue_ids) | contains_any(value, "failure_message"))


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
