"""Shared pieces of the ops admin: large-table changelists, live badges, event timelines."""

from __future__ import annotations

import functools
import json
import uuid

from django.contrib import admin
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import DateTimeField, Q
from django.utils.functional import cached_property
from django.utils.html import format_html

from .audit import audit_entries_for
from .ids import short_id
from .models import Event
from .redaction import redact_data
from .times import duration_html, when_html

COUNT_CAP = 10_000


class EstimatedCountPaginator(Paginator):
    """Never counts a large table row by row, and always costs one query.

    Unfiltered lists on PostgreSQL use the planner's estimate when it is above COUNT_CAP (and a
    capped count below it, in the same statement); filtered lists count at most COUNT_CAP + 1
    rows, so the query cost does not grow with the table.
    """

    @cached_property
    def count(self):
        qs = self.object_list
        query = getattr(qs, "query", None)
        if query is not None and not query.where and connection.vendor == "postgresql":
            table = connection.ops.quote_name(qs.model._meta.db_table)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT CASE WHEN c.reltuples > %s THEN c.reltuples::bigint "
                    f"ELSE (SELECT count(*) FROM (SELECT 1 FROM {table} LIMIT %s) capped) END "
                    "FROM pg_class c WHERE c.oid = %s::regclass",
                    [COUNT_CAP, COUNT_CAP + 1, qs.model._meta.db_table],
                )
                return int(cursor.fetchone()[0])
        return qs[: COUNT_CAP + 1].count()


class DistinctValuesFilter(admin.SimpleListFilter):
    """Filter choices read with an index skip scan: one short index probe per distinct value.

    Django's default filter for a field without choices runs SELECT DISTINCT over the whole table.
    """

    field_name = ""
    max_choices = 100

    def lookups(self, request, model_admin):
        model = model_admin.model
        table = connection.ops.quote_name(model._meta.db_table)
        column = connection.ops.quote_name(model._meta.get_field(self.field_name).column)
        if connection.vendor == "postgresql":
            sql = (f"WITH RECURSIVE v AS ((SELECT {column} AS x FROM {table} ORDER BY 1 LIMIT 1) UNION ALL "
                   f"SELECT (SELECT {column} FROM {table} WHERE {column} > v.x ORDER BY 1 LIMIT 1) FROM v "
                   f"WHERE v.x IS NOT NULL) SELECT x FROM v WHERE x IS NOT NULL LIMIT %s")
        else:
            sql = f"SELECT DISTINCT {column} FROM {table} ORDER BY 1 LIMIT %s"
        with connection.cursor() as cursor:
            cursor.execute(sql, [self.max_choices])
            return [(row[0], row[0]) for row in cursor.fetchall()]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(**{self.field_name: self.value()})
        return queryset


def live_badge(obj, field: str = "status", label: str | None = None):
    """A status badge that /static/chorus/live.js updates in place when an event names ``obj``."""
    value = getattr(obj, field)
    return format_html(
        '<span class="chorus-badge chorus-{}" data-live-id="{}" data-live-field="{}">{}</span>',
        value, obj.pk, field, label if label is not None else value.replace("_", " "),
    )


def id_cell(value):
    """An id as people read it: the distinguishing tail, the whole id on hover (and to copy)."""
    if not value:
        return "–"
    return format_html('<span class="chorus-id" title="{}">{}</span>', value, short_id(value))


def _redacted_display(name: str):
    @admin.display(description=f"{name} (redacted)")
    def show(self, obj):
        return json.dumps(redact_data(getattr(obj, name)), indent=1, sort_keys=True, default=str)

    return show


class OpsAdmin(admin.ModelAdmin):
    """Read-mostly admin for ops records: services change state, never this form."""

    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    list_per_page = 50
    live_streams: tuple[str, ...] = ()  # streams the changelist follows: ("dashboard",)
    # Searched by exact id when the term is a UUID (an indexed lookup instead of a text scan).
    uuid_search_fields: tuple[str, ...] = ()
    change_form_template = "admin/chorus/change_form.html"
    change_list_template = "admin/chorus/change_list.html"

    def has_add_permission(self, request):
        return False

    # Related rows whose names __str__ uses (breadcrumbs, page title): loaded with the object.
    detail_select_related: tuple[str, ...] = ()

    def get_object(self, request, object_id, from_field=None):
        if not self.detail_select_related:
            return super().get_object(request, object_id, from_field)
        queryset = self.get_queryset(request).select_related(*self.detail_select_related)
        field = self.model._meta.pk if from_field is None else self.model._meta.get_field(from_field)
        try:
            return queryset.get(**{field.name: field.to_python(object_id)})
        except (self.model.DoesNotExist, ValidationError, ValueError):
            return None

    @admin.display(description="id", ordering="id")
    def id_short(self, obj):
        return id_cell(obj.pk)

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if self.uuid_search_fields and term:
            try:
                value = uuid.UUID(term)
            except ValueError:
                pass
            else:
                condition = Q()
                for field in self.uuid_search_fields:
                    condition |= Q(**{field: value})
                # Exact-match text fields too: an agent's own session id is often a UUID
                # (Claude Code's), and the page shows it to be searched for.
                for field in self.search_fields or ():
                    if field.startswith("="):
                        condition |= Q(**{f"{field[1:]}__iexact": term})
                    elif field.endswith("__exact"):
                        condition |= Q(**{field: term})
                return queryset.filter(condition), False
        if not self.search_fields:
            return queryset, False
        return super().get_search_results(request, queryset, search_term)

    def has_delete_permission(self, request, obj=None):
        return False  # history is never rewritten (SPEC §1 rule 5)

    def has_change_permission(self, request, obj=None):
        return False  # read-only: state changes go through actions, i.e. services

    # JSON fields that may hold a credential: never shown raw, only as ``<name>_redacted``
    # (through redact_data: values under secret-like names are masked, strings are redacted).
    redacted_fields: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.redacted_fields:
            setattr(cls, f"{name}_redacted", _redacted_display(name))

    def get_exclude(self, request, obj=None):
        # Date-times are shown by readable_times() below, not as raw form values.
        return [*(super().get_exclude(request, obj) or []), *self.redacted_fields, *datetime_names(self.model)]

    def get_readonly_fields(self, request, obj=None):
        return readable_times(self.model, [f.name for f in self.model._meta.fields if f.name not in self.redacted_fields]
                              + [f"{name}_redacted" for name in self.redacted_fields] + list(self.readonly_fields))

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
                "chorus_audit": list(audit_entries_for(f"{self.model._meta.model_name}:{obj.pk}")[:50]),
                **self.extra_detail_context(request, obj),
            })
        return super().change_view(request, object_id, form_url, extra_context=context)

    def changelist_view(self, request, extra_context=None):
        context = {"chorus_streams": list(self.live_streams), **(extra_context or {})}
        return super().changelist_view(request, extra_context=context)

    # -- readable times in lists (issue 11 item 3)
    def get_list_display(self, request):
        """Every date-time column reads "3 min ago" (absolute on hover); a record with a start and an
        end (started_at with ended_at or completed_at) gets a duration column, ticking while under way."""
        columns = []
        fields = {f.name: f for f in self.model._meta.concrete_fields}
        end = next((name for name in ("ended_at", "completed_at") if name in fields), None)
        wants_duration = "started_at" in fields and end is not None
        for name in super().get_list_display(request):
            field = fields.get(name) if isinstance(name, str) else None
            columns.append(when_column(name, field.verbose_name) if isinstance(field, DateTimeField) else name)
            if wants_duration and name == end:
                columns.append(duration_column("started_at", end))
                wants_duration = False
        if wants_duration:
            columns.append(duration_column("started_at", end))
        return columns


def datetime_names(model) -> list[str]:
    return [f.name for f in model._meta.concrete_fields if isinstance(f, DateTimeField)]


def readable_times(model, names: list) -> list:
    """A detail page's fields with each date-time read as "3 min ago" (absolute on hover) and, for a
    record with a start and an end, its duration after the end."""
    fields = {f.name: f for f in model._meta.concrete_fields}
    end = next((name for name in ("ended_at", "completed_at") if name in fields), None)
    shown = []
    for name in names:
        field = fields.get(name) if isinstance(name, str) else None
        shown.append(when_column(name, field.verbose_name) if isinstance(field, DateTimeField) else name)
        if name == end and "started_at" in fields:
            shown.append(duration_column("started_at", end))
    return shown


# Cached: Django's admin compares the fields it is given with the read-only ones, so asking twice
# must give the same column objects (a new closure each time read as an unknown form field).
@functools.cache
def when_column(name: str, label: str):
    @admin.display(description=label, ordering=name)
    def column(obj):
        return when_html(getattr(obj, name))

    column.__name__ = name  # the changelist's CSS class (column-started_at) stays the field's
    return column


@functools.cache
def duration_column(start: str, end: str):
    @admin.display(description="duration")
    def column(obj):
        return duration_html(getattr(obj, start), getattr(obj, end))

    column.__name__ = "duration"
    return column
