"""What needs an operator in executions (issue 11): failed runs, approvals and reviews waiting.
The dashboard counts these querysets and links to the changelist filter that lists the same rows."""

from __future__ import annotations

from datetime import datetime

from django.contrib import admin
from django.db.models import QuerySet
from django.utils import timezone

from sessions_app.attention import RECENT

from .models import Approval, Issue, Run


def runs_failed_since(since: datetime) -> QuerySet:
    return Run.objects.filter(state="failed", completed_at__gte=since)


def approvals_waiting() -> QuerySet:
    return Approval.objects.filter(status="pending")


def issues_waiting_review() -> QuerySet:
    return Issue.objects.filter(status="in_review")


class RunAttentionFilter(admin.SimpleListFilter):
    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request, model_admin):
        return [("failed_24h", "failed in the last 24 h")]

    def queryset(self, request, queryset):
        if self.value() == "failed_24h":
            return queryset & runs_failed_since(timezone.now() - RECENT)
        return queryset
