"""Shared pieces of the ops admin: large-table changelists, live badges, event timelines."""

from __future__ import annotations

import json

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connection
from django.utils.functional import cached_property
from django.utils.html import format_html

from .models import AuditEntry, Event

COUNT_CAP = 10_000


class EstimatedCountPaginator(Paginator):
    """Never counts a large table row by row.

    Unfiltered lists on PostgreSQL use the planner's estimate; filtered lists count at most
    COUNT_CAP + 1 rows, so the query cost does not grow with the table.
    """

    @cached_property
    def count(self):
        qs = self.object_list
        query = getattr(qs, "query", None)
        if query is not None and not query.where and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                               [qs.model._meta.db_table])
                row = cursor.fetchone()
            if row and row[0] > COUNT_CAP:
                return int(row[0])
        return qs[: COUNT_CAP + 1].count()


def live_badge(obj, field: str = "status", label: str | None = None):
    """A status badge that /static/chorus/live.js updates in place when an event names ``obj``."""
    value = getattr(obj, field)
    return format_html(
        '<span class="chorus-badge chorus-{}" data-live-id="{}" data-live-field="{}">{}</span>',
        value, obj.pk, field, label if label is not None else value.replace("_", " "),
    )


class OpsAdmin(admin.ModelAdmin):
    """Read-mostly admin for ops records: services change state, never this form."""

    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    list_per_page = 50
    live_streams: tuple[str, ...] = ()  # streams the changelist follows: ("dashboard",)
    change_form_template = "admin/chorus/change_form.html"
    change_list_template = "admin/chorus/change_list.html"

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # history is never rewritten (SPEC §1 rule 5)

    def has_change_permission(self, request, obj=None):
        return False  # read-only: state changes go through actions, i.e. services

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields] + list(self.readonly_fields)

    # -- timeline and live streams on the detail page
    def object_stream(self, obj) -> str | None:
        return None

    def timeline_filter(self, obj) -> dict:
        return {}

    def timeline(self, obj, limit: int = 100):
        stream = self.object_stream(obj)
        if not stream:
            return []
        events = list(Event.objects.filter(stream=stream, **self.timeline_filter(obj)).order_by("-id")[:limit])
        for event in events:
            event.data_json = json.dumps(event.data, separators=(",", ":"))  # as the live rows show it
        return events

    def extra_detail_context(self, request, obj) -> dict:
        return {}

    def change_view(self, request, object_id, form_url="", extra_context=None):
        obj = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if obj is not None:
            stream = self.object_stream(obj)
            context.update({
                "chorus_timeline": self.timeline(obj),
                "chorus_streams": [stream] if stream else [],
                "chorus_audit": list(AuditEntry.objects.filter(target=f"{self.model._meta.model_name}:{obj.pk}")[:50]),
                **self.extra_detail_context(request, obj),
            })
        return super().change_view(request, object_id, form_url, extra_context=context)

    def changelist_view(self, request, extra_context=None):
        context = {"chorus_streams": list(self.live_streams), **(extra_context or {})}
        return super().changelist_view(request, extra_context=context)
