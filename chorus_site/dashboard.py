"""The admin index as the operator's dashboard (issue 11 item 1).

What needs attention first (each a count linking to the changelist filtered to the same rows), then
turns and runs by state over the last 24 hours, connections with their last heartbeat, and recent
operator actions.  Role-aware: a section shows only what the user may view.

Cost does not grow with the tables: the counts are one statement of capped counts over indexed
conditions, the charts read the last 24 hours through an index, the lists are short.  Live: the page
follows the ``dashboard`` stream and, on any wake-up from it (or on reconnect, or every
``REFRESH_S`` anyway), re-reads :func:`summary_view` — the log stays the truth, the socket only says when.

This module sits at the top floor (beside urls.py and api.py): it reads both apps.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.contrib import admin
from django.db import connection
from django.db.models import Case, Count, IntegerField, QuerySet, Value, When
from django.db.models.functions import TruncHour
from django.http import JsonResponse
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache

from chorus_site.ids import short_id
from chorus_site.models import AuditEntry
from chorus_site.permissions import has_ops_role
from chorus_site.times import iso
from executions import attention as run_attention
from executions.models import Run
from executions.states import RUN_STATES
from sessions_app import attention as turn_attention
from sessions_app.models import Connection, Turn
from sessions_app.states import TURN_STATUSES

COUNT_CAP = 999  # a count above it reads "999+": counting never scans a large table
CHART_HOURS = 24
CONNECTIONS_SHOWN = 12
AUDIT_SHOWN = 10
REFRESH_S = 30  # time alone changes some counts (a heartbeat going stale, the 24 h window)

# Audit targets ("turn:<id>") and the admin page each names.
TARGET_PAGES = {"turn": "sessions_app_turn", "session": "sessions_app_session", "connection": "sessions_app_connection",
                "run": "executions_run", "issue": "executions_issue", "approval": "executions_approval",
                "task": "executions_agenttask", "attempt": "executions_attempt",
                "workflow": "executions_workflowdefinition", "apitoken": "chorus_site_apitoken"}


def uuid7_floor(moment: datetime) -> uuid.UUID:
    """The smallest UUIDv7 of ``moment``'s millisecond (chorus_site.ids): ids are made at creation,
    so ``id >= uuid7_floor(t)`` reads rows created since ``t`` through the primary key's index."""
    millis = int(moment.timestamp() * 1000)
    return uuid.UUID(int=(millis & ((1 << 48) - 1)) << 80 | 0x7 << 76 | 0b10 << 62)


def capped_counts(querysets: dict[str, QuerySet], cap: int = COUNT_CAP) -> dict[str, int]:
    """Each queryset's row count up to ``cap`` + 1, all in one statement."""
    if not querysets:
        return {}
    parts, params = [], []
    for qs in querysets.values():
        sql, qs_params = qs.order_by().values("pk")[: cap + 1].query.sql_with_params()
        parts.append(f"(SELECT count(*) FROM ({sql}) AS capped)")
        params.extend(qs_params)
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(parts), params)
        return dict(zip(querysets, cursor.fetchone()))


def _changelist(name: str, query: str = "") -> str:
    return reverse(f"admin:{name}_changelist") + (f"?{query}" if query else "")


def _attention(user, now: datetime) -> list[dict]:
    """(key, label, queryset, link, tone) of each needs-attention item this user may see, in order."""
    items = []
    if user.has_perm("sessions_app.view_turn"):
        for key, (label, queryset) in turn_attention.TURN_ATTENTION.items():
            items.append((f"turns_{key}", f"Turns {label}", queryset(now),
                          _changelist("sessions_app_turn", f"attention={key}")))
    if user.has_perm("executions.view_run"):
        items.append(("runs_failed_24h", "Runs failed in the last 24 h",
                      run_attention.runs_failed_since(now - turn_attention.RECENT),
                      _changelist("executions_run", "attention=failed_24h")))
    if user.has_perm("executions.view_approval"):
        link = (reverse("admin:executions_issue_inbox") if user.has_perm("executions.decide_approval")
                else _changelist("executions_approval", "status__exact=pending"))
        items.append(("approvals_waiting", "Approvals waiting", run_attention.approvals_waiting(), link))
    if user.has_perm("executions.view_issue"):
        link = (reverse("admin:executions_issue_inbox") if user.has_perm("executions.accept_issue")
                else _changelist("executions_issue", "status__exact=in_review"))
        items.append(("reviews_waiting", "Reviews waiting", run_attention.issues_waiting_review(), link))
    if user.has_perm("sessions_app.view_connection"):
        items.append(("connections_down", "Connections offline or draining", turn_attention.connections_down(),
                      _changelist("sessions_app_connection", "status__in=offline,draining")))
    counts = capped_counts({key: qs for key, _, qs, _ in items})
    return [{"key": key, "label": label, "count": min(counts[key], COUNT_CAP), "capped": counts[key] > COUNT_CAP,
             "url": url} for key, label, _, url in items]


def _by_hour(queryset: QuerySet, field: str, states: list[str], now: datetime) -> dict:
    """Rows created in each of the last CHART_HOURS hours, by their current state."""
    first = (now - timedelta(hours=CHART_HOURS - 1)).replace(minute=0, second=0, microsecond=0)
    hours = [first + timedelta(hours=i) for i in range(CHART_HOURS)]
    rows = (queryset.filter(id__gte=uuid7_floor(first), created_at__gte=first)
            .annotate(hour=TruncHour("created_at")).values_list("hour", field).annotate(n=Count("pk")).order_by())
    index = {hour: i for i, hour in enumerate(hours)}
    series = {state: [0] * CHART_HOURS for state in states}
    for hour, state, n in rows:
        if hour in index and state in series:
            series[state][index[hour]] = n
    return {"hours": [iso(h) for h in hours],
            "series": [{"state": state, "values": values} for state, values in series.items() if any(values)]}


def _connections(now: datetime) -> dict:
    down_first = Case(When(status="online", then=Value(1)), default=Value(0), output_field=IntegerField())
    rows = list(Connection.objects.order_by(down_first, "name")
                .values("pk", "name", "host", "status", "last_heartbeat_at")[: CONNECTIONS_SHOWN + 1])
    counts = dict(Connection.objects.values_list("status").annotate(n=Count("pk")).order_by())
    return {
        "counts": {status: counts.get(status, 0) for status in ("online", "draining", "offline")},
        "rows": [{"name": r["name"], "host": r["host"], "status": r["status"],
                  "last_heartbeat_at": iso(r["last_heartbeat_at"]) if r["last_heartbeat_at"] else None,
                  "url": reverse("admin:sessions_app_connection_change", args=[r["pk"]])}
                 for r in rows[:CONNECTIONS_SHOWN]],
        "more": len(rows) > CONNECTIONS_SHOWN,
    }


def _target_url(target: str) -> str | None:
    kind, _, object_id = target.partition(":")
    name = TARGET_PAGES.get(kind)
    if not name or not object_id:
        return None
    try:
        return reverse(f"admin:{name}_change", args=[object_id])
    except NoReverseMatch:
        return None


def _target_label(target: str) -> str:
    """"turn …5b0596bd" — the distinguishing tail of the id (chorus_site.ids), the whole one on hover."""
    kind, _, object_id = target.partition(":")
    return f"{kind} {short_id(object_id)}" if object_id else target


def _audit() -> list[dict]:
    return [{"at": iso(a.at), "actor": a.actor, "action": a.action, "target": a.target,
             "target_label": _target_label(a.target), "target_url": _target_url(a.target), "outcome": a.outcome,
             "client": a.client}
            for a in AuditEntry.objects.order_by("-id")[:AUDIT_SHOWN]]


def summary(user, now: datetime | None = None) -> dict:
    """Everything the dashboard shows, as JSON-ready data: the page renders it, the live client
    re-reads it.  Sections the user may not view are absent (None)."""
    now = now or timezone.now()
    charts = {}
    if user.has_perm("sessions_app.view_turn"):
        charts["turns"] = _by_hour(Turn.objects.all(), "status", TURN_STATUSES, now)
    if user.has_perm("executions.view_run"):
        charts["runs"] = _by_hour(Run.objects.all(), "state", RUN_STATES, now)
    return {
        "at": iso(now),
        "refresh_s": REFRESH_S,
        "attention": _attention(user, now),
        "charts": charts,
        "connections": _connections(now) if user.has_perm("sessions_app.view_connection") else None,
        "audit": _audit() if user.has_perm("chorus_site.view_auditentry") else None,
    }


def index_view(request):
    """The admin index: the stock app list, with the dashboard above it for the ops roles."""
    context = {}
    if has_ops_role(request.user):
        context = {"dashboard": summary(request.user), "chorus_streams": ["dashboard"],
                   "summary_url": reverse("chorus_dashboard_summary")}
    return admin.site.index(request, extra_context=context)


@never_cache
def summary_view(request):
    """GET: the dashboard's data (what :func:`index_view` renders), re-read by the live page."""
    if not has_ops_role(request.user):
        return JsonResponse({"code": "forbidden", "message": "an ops role is needed"}, status=403)
    return JsonResponse(summary(request.user))
