"""Sessions section of the ops admin (SPEC §3.1): read views with live badges and timelines."""

from django.contrib import admin, messages
from django.db import transaction
from django.urls import path, reverse
from django.utils.html import format_html

from chorus_site.admin_base import OpsAdmin, live_badge
from chorus_site.audit import audit_record
from chorus_site.permissions import can_view_diagnostics

from . import actions, admin_views, selectors
from .attention import TurnAttentionFilter
from .models import BackendSetting, Connection, ControlCommand, Session, TranscriptMessage, Turn
from .services import connection_register, connection_set_stall_threshold


class StalledFilter(admin.SimpleListFilter):
    """Running turns flagged stalled (sessions_app/stalls.py), the same rows as TurnFilter's ``stalled``."""

    title = "stalled"
    parameter_name = "stalled"

    def lookups(self, request, model_admin):
        return [("yes", "stalled"), ("no", "not stalled")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(pk__in=selectors.turns_stalled().values("pk"))
        if self.value() == "no":
            return queryset.exclude(pk__in=selectors.turns_stalled().values("pk"))
        return queryset


@admin.register(Connection)
class ConnectionAdmin(OpsAdmin):
    list_display = ["name", "host", "backend", "status_badge", "last_heartbeat_at", "daemon_version",
                    "max_concurrency"]
    list_filter = ["status", "backend"]
    search_fields = ["name", "host"]
    live_streams = ("dashboard",)
    change_form_template = "admin/sessions_app/connection/change_form.html"
    fields_on_add = ["name", "host", "backend", "cwds", "max_concurrency", "sigint_timeout_s", "auto_resume_crashed",
                     "stall_threshold_s"]

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj):
        return live_badge(obj)

    def object_stream(self, obj):
        return f"connection:{obj.pk}"

    # ops_admin registers connections here; the key is shown once, then only its hash is kept.
    def has_add_permission(self, request):
        return request.user.has_perm("sessions_app.add_connection")

    def get_fields(self, request, obj=None):
        return self.fields_on_add if obj is None else super().get_fields(request, obj)

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return []
        readonly = super().get_readonly_fields(request, obj)
        if self.has_change_permission(request, obj):
            readonly = [f for f in readonly if f != "stall_threshold_s"]
        return readonly

    def _register(self, request, obj, form):
        data = form.cleaned_data
        connection, key = connection_register(
            name=data["name"], host=data.get("host", ""), backend=data["backend"], cwds=data["cwds"],
            max_concurrency=data["max_concurrency"], sigint_timeout_s=data["sigint_timeout_s"], actor=request.user,
            auto_resume_crashed=data.get("auto_resume_crashed", False),
            stall_threshold_s=data.get("stall_threshold_s"),
        )
        obj.pk = connection.pk
        audit_record(actor=request.user, action="connection.register", target=f"connection:{connection.pk}",
                     outcome="registered", client="admin")
        messages.warning(request, format_html(
            "Connection key (shown once, store it now): <code>{}</code> — start the daemon with "
            "<code>python manage.py chorus_daemon --portal URL --key KEY</code>", key))

    # ops_admin (change_connection) may set the stall threshold; everything else stays read-only.
    def has_change_permission(self, request, obj=None):
        return request.user.has_perm("sessions_app.change_connection")

    def save_model(self, request, obj, form, change):
        if not change:
            return self._register(request, obj, form)
        connection_set_stall_threshold(connection_id=obj.pk, stall_threshold_s=form.cleaned_data["stall_threshold_s"],
                                       actor=request.user, client="admin")

    def log_addition(self, request, obj, message):
        return None  # the audit entry above records it

    def log_change(self, request, obj, message):
        return None  # connection_set_stall_threshold records the audit entry

    def get_urls(self):
        view = self.admin_site.admin_view
        return [path("<path:object_id>/start/", view(lambda r, object_id: admin_views.connection_start_view(
            self, r, object_id)), name="sessions_app_connection_start")] + super().get_urls()

    def extra_detail_context(self, request, obj):
        return {"can_start": request.user.has_perm("sessions_app.start_session"),
                "spool": selectors.connection_spool_health(obj)}


@admin.register(Session)
class SessionAdmin(OpsAdmin):
    list_display = ["title", "idea_key", "connection", "cwd", "backend", "status_badge", "state_reason",
                    "last_turn_at"]
    list_filter = ["status", "backend", "connection"]
    search_fields = ["title", "idea_key", "cwd", "backend_session_id__exact"]
    uuid_search_fields = ("pk", "connection_id")
    list_select_related = ["connection"]
    live_streams = ("dashboard",)
    change_form_template = "admin/sessions_app/session/change_form.html"

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj):
        return live_badge(obj)

    def get_changelist(self, request, **kwargs):
        class SessionChangeList(super().get_changelist(request, **kwargs)):
            def get_results(self, request):
                super().get_results(request)
                selectors.attach_last_turns(self.result_list)

        return SessionChangeList

    @staticmethod
    def _state(obj):
        return selectors.session_state(obj, seq=getattr(obj, "last_turn_seq", None),
                                       status=getattr(obj, "last_turn_status", None),
                                       reason=getattr(obj, "last_turn_reason", None))

    def _state_of(self, obj):
        selectors.attach_last_turns([obj])
        return self._state(obj)

    @admin.display(description="state")
    def state_reason(self, obj):
        label, why = self._state(obj)
        return format_html('<span class="chorus-badge chorus-state-{}">{}</span> <span class="chorus-muted">{}</span>',
                           label.replace(" ", ""), label, why)

    def object_stream(self, obj):
        return obj.stream

    def get_urls(self):
        view = self.admin_site.admin_view
        routes = [("resume", admin_views.session_resume_view), ("handoff", admin_views.session_handoff_view),
                  ("message", admin_views.session_message_view)]
        return [path(f"<path:object_id>/{name}/", view(self._bind(fn)), name=f"sessions_app_session_{name}")
                for name, fn in routes] + super().get_urls()

    def _bind(self, fn):
        return lambda request, object_id: fn(self, request, object_id)

    @staticmethod
    def _turns_with_reasons(obj):
        turns = list(obj.turns.select_related("connection").order_by("-seq")[:50])
        for turn in turns:  # a pending turn says why it waits (connection offline, queued, …)
            turn.pending_why = selectors.pending_reason(turn, turn.connection or obj.connection)
        return turns

    def extra_detail_context(self, request, obj):
        user = request.user
        return {
            "can_resume": user.has_perm("sessions_app.resume_session"),
            "can_handoff": user.has_perm("sessions_app.handoff_session"),
            "can_message": user.has_perm("sessions_app.message_session") and obj.status == "active",
            "turns": self._turns_with_reasons(obj),
            "handoff_to": Session.objects.filter(handoff_from=obj).first(),
            "transcript": list(obj.transcript.order_by("-id")[:20])[::-1],
            "takeover": selectors.takeover_for(obj),
            "session_state": self._state_of(obj),
            "turn_url_template": reverse("admin:sessions_app_turn_change",
                                         args=["00000000-0000-0000-0000-000000000000"]),
        }


@admin.register(Turn)
class TurnAdmin(OpsAdmin):
    list_display = ["turn_link", "session", "status_badge", "stalled_badge", "trigger", "interrupted_reason",
                    "stop_state_badge", "started_at", "ended_at"]
    list_filter = ["status", StalledFilter, "interrupted_reason", "trigger", "stop_state"]
    uuid_search_fields = ("pk", "session_id", "attempt_id")
    search_fields = ["prompt"]  # only used when the term is not an id
    list_select_related = ["session"]
    raw_id_fields = ["session"]
    detail_select_related = ("session",)
    live_streams = ("dashboard",)
    change_form_template = "admin/sessions_app/turn/change_form.html"
    actions = ["interrupt_selected", "mark_interrupted_selected"]

    def get_list_filter(self, request):
        return [TurnAttentionFilter, *super().get_list_filter(request)]  # what the dashboard counts

    def get_urls(self):
        view = self.admin_site.admin_view
        routes = [("interrupt", admin_views.turn_interrupt_view),
                  ("mark-interrupted", admin_views.turn_mark_interrupted_view)]
        return [path(f"<path:object_id>/{name}/", view(self._bind(fn)),
                     name=f"sessions_app_turn_{name.replace('-', '_')}") for name, fn in routes] + super().get_urls()

    def _bind(self, fn):
        return lambda request, object_id: fn(self, request, object_id)

    @admin.action(description="Interrupt selected turns", permissions=["interrupt"])
    def interrupt_selected(self, request, queryset):
        return admin_views.bulk_turns(
            self, request, queryset, perm="sessions_app.interrupt_turn", label="Interrupt selected turns",
            run=lambda turn: actions.turn_interrupt(actor=request.user, turn_id=turn.pk, client="admin"))

    @admin.action(description="Clear selected stuck turns (mark interrupted)", permissions=["mark_interrupted"])
    def mark_interrupted_selected(self, request, queryset):
        def run(turn):
            evidence = actions.turn_gather_evidence(turn_id=turn.pk, probe_wait_s=1.0)
            return actions.turn_mark_interrupted(actor=request.user, turn_id=turn.pk, evidence=evidence,
                                                 client="admin")

        return admin_views.bulk_turns(self, request, queryset, perm="sessions_app.mark_interrupted_turn",
                                      label="Clear selected stuck turns", run=run)

    def has_interrupt_permission(self, request):
        return request.user.has_perm("sessions_app.interrupt_turn")

    def has_mark_interrupted_permission(self, request):
        return request.user.has_perm("sessions_app.mark_interrupted_turn")

    @admin.display(description="turn")
    def turn_link(self, obj):
        return f"#{obj.seq}"  # the changelist makes the first column the link

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj):
        return format_html("{} {}", live_badge(obj, label=obj.status_label), retrying_badge(obj))

    @admin.display(description="stop", ordering="stop_state")
    def stop_state_badge(self, obj):
        return live_badge(obj, "stop_state")

    @admin.display(description="stalled", ordering="stalled_at")
    def stalled_badge(self, obj):
        return live_badge(obj, "stalled")

    # Shown live in the State panel instead (a static copy would go stale on the page), or
    # readably in a panel of their own (changes: a file list and a diff, never a dict).
    live_fields = {"wake_error", "status", "interrupted_reason", "stop_state", "changes",
                   "stalled_at", "stall_evidence"}  # the Stalled panel shows these

    def get_readonly_fields(self, request, obj=None):
        return [f for f in super().get_readonly_fields(request, obj) if f not in self.live_fields]

    def get_fields(self, request, obj=None):
        return [f for f in super().get_fields(request, obj) if f not in self.live_fields]

    def object_stream(self, obj):
        return obj.stream

    def timeline_filter(self, obj):
        return {"data__id": str(obj.pk)}

    def extra_detail_context(self, request, obj):
        show_details = bool(obj.wake_error) and can_view_diagnostics(request.user)
        if show_details:
            audit_record(actor=request.user, action="diagnostics.view", target=f"turn:{obj.pk}", outcome="shown",
                         client="admin")
        active = obj.status in {"running", "requires_action", "pending"}
        return {
            "can_interrupt": active and request.user.has_perm("sessions_app.interrupt_turn"),
            "can_mark_interrupted": obj.status in {"running", "requires_action"}
            and request.user.has_perm("sessions_app.mark_interrupted_turn"),
            "wake_error": selectors.wake_error_out(obj.wake_error, with_details=show_details),
            "changes": selectors.changes_view(obj.changes),
            "pending_why": selectors.pending_reason(obj),
            "status_badge": live_badge(obj, label=obj.status_label),
            "stop_badge": live_badge(obj, "stop_state"),
            "retrying_badge": retrying_badge(obj),
            **self._stall_context(request, obj),
        }

    def _stall_context(self, request, obj):
        """The Stalled panel: the evidence and the operator's options (interrupt, a message, wait)."""
        stalled = obj.stalled == "stalled"
        session = obj.session
        return {
            "stalled": stalled, "stall_evidence": obj.stall_evidence,
            "stall_badge": live_badge(obj, "stalled"),
            "can_message_session": stalled and session.status == "active"
            and request.user.has_perm("sessions_app.message_session"),
            "session_message_url": reverse("admin:sessions_app_session_message", args=[session.pk]),
        }


def retrying_badge(turn: Turn):
    """"retrying: authentication failed (attempt 4 of 10, next in 9 s)" while the turn's CLI retries a
    model call itself (selectors.turn_retrying); empty otherwise. /static/chorus/live.js sets and
    clears it as turn.retrying events arrive (bridge._retrying_follow)."""
    retrying = selectors.turn_retrying(turn)
    return format_html('<span class="chorus-retrying" data-live-id="{}" data-live-field="retrying"{}>{}</span>',
                       turn.pk, "" if retrying else " hidden", retrying["message"] if retrying else "")


@admin.register(TranscriptMessage)
class TranscriptMessageAdmin(OpsAdmin):
    list_display = ["session", "role", "short_text", "at"]
    list_filter = ["role"]
    list_select_related = ["session"]
    raw_id_fields = ["session", "turn"]

    @admin.display(description="text")
    def short_text(self, obj):
        return obj.text[:120]


@admin.register(ControlCommand)
class ControlCommandAdmin(OpsAdmin):
    list_display = ["id_short", "action", "connection", "turn", "state_badge", "created_at", "acked_at"]
    list_filter = ["action", "state"]
    list_select_related = ["connection", "turn"]
    raw_id_fields = ["connection", "turn"]
    live_streams = ("dashboard",)
    redacted_fields = ("payload", "result")

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj):
        return live_badge(obj, "state")

    def object_stream(self, obj):
        return f"connection:{obj.connection_id}"

    def timeline_filter(self, obj):
        return {"data__id": str(obj.pk)}


@admin.register(BackendSetting)
class BackendSettingAdmin(admin.ModelAdmin):
    """Per-backend defaults (stall threshold), edited by ops_admin; a connection's own value wins."""

    list_display = ["backend", "stall_threshold_s"]

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        audit_record(actor=request.user, action="backend_setting.change" if change else "backend_setting.add",
                     target=f"backend:{obj.backend}", outcome=f"stall_threshold_s={obj.stall_threshold_s}",
                     client="admin")

    def delete_model(self, request, obj):
        audit_record(actor=request.user, action="backend_setting.delete", target=f"backend:{obj.backend}",
                     outcome="deleted", client="admin")
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        # "delete selected" bypasses delete_model: every deleted row is audited, in the deletion's transaction
        with transaction.atomic():
            for backend in queryset.values_list("backend", flat=True):
                audit_record(actor=request.user, action="backend_setting.delete", target=f"backend:{backend}",
                             outcome="deleted", client="admin")
            super().delete_queryset(request, queryset)
