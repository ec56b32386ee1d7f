"""Executions section of the ops admin (SPEC §3.2): runs with their task map, live."""

from django import forms
from django.contrib import admin
from django.urls import path, reverse
from django.utils.html import format_html

from chorus_site.admin_base import OpsAdmin, id_cell, live_badge
from chorus_site.audit import audit_record
from chorus_site.errors import ApplicationError

from . import admin_views, selectors, services, states, troubleshooting, workflows
from .attention import RunAttentionFilter
from .models import AgentTask, Approval, Artifact, Attempt, Comment, Issue, Run, RunNode, WorkflowDefinition, WorkflowRevision


def run_wait_text(run) -> str:
    """What a waiting run waits for and what unblocks it; "" when it does not wait."""
    if run.state != "waiting":
        return ""
    reason = (run.wait_reason or "reason not recorded").replace("_", " ")
    unblock = (run.wait_detail or {}).get("unblock")
    return f"{reason}: {unblock}" if unblock else reason


def _link(obj, label=None):
    if obj is None:
        return "–"
    url = reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])
    return format_html('<a href="{}">{}</a>', url, label or obj)


@admin.register(Issue)
class IssueAdmin(OpsAdmin):
    list_display = ["title", "status_badge", "completion_policy", "assignee", "updated_at"]
    list_filter = ["status", "completion_policy"]
    search_fields = ["title"]
    uuid_search_fields = ("pk",)
    list_select_related = ["assignee"]
    live_streams = ("dashboard",)
    editable_fields = ["title", "body", "acceptance_criteria", "completion_policy", "assignee"]

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj):
        return live_badge(obj)

    def object_stream(self, obj):
        return f"issue:{obj.pk}"

    # Operators write issues; status moves only through the workflow services.
    def has_add_permission(self, request):
        return request.user.has_perm("executions.add_issue")

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm("executions.change_issue")

    def get_fields(self, request, obj=None):
        return self.editable_fields + ([] if obj is None else ["status", "version", "created_at", "updated_at"])

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else ["status", "version", "created_at", "updated_at"]

    def save_model(self, request, obj, form, change):
        # Writing an issue is an operator action: audited as in the API (SPEC §3), created through
        # the same service (its issue.created event); an edit writes only the fields it changed,
        # never a status or version read a moment earlier.
        if change:
            if form.changed_data:
                obj.save(update_fields=[*form.changed_data, "updated_at"])
            audit_record(actor=request.user, action="issue.edit", target=f"issue:{obj.pk}", client="admin",
                         outcome=f"changed {', '.join(form.changed_data)}" if form.changed_data else "unchanged")
            return
        issue = services.issue_create(title=obj.title, body=obj.body, acceptance_criteria=obj.acceptance_criteria,
                                      completion_policy=obj.completion_policy, actor=request.user)
        if obj.assignee_id:
            Issue.objects.filter(pk=issue.pk).update(assignee_id=obj.assignee_id)
        obj.pk, obj._state.adding = issue.pk, False
        audit_record(actor=request.user, action="issue.create", target=f"issue:{issue.pk}", outcome="created",
                     client="admin")

    change_form_template = "admin/executions/issue/change_form.html"
    change_list_template = "admin/executions/issue/change_list.html"

    def get_urls(self):
        view = self.admin_site.admin_view(lambda request, object_id: admin_views.issue_start_run_view(
            self, request, object_id))
        inbox = self.admin_site.admin_view(lambda request: admin_views.inbox_view(self, request))
        reopen = self.admin_site.admin_view(lambda request, object_id: admin_views.issue_reopen_view(
            self, request, object_id))
        return [path("inbox/", inbox, name="executions_issue_inbox"),
                path("<path:object_id>/reopen/", reopen, name="executions_issue_reopen"),
                path("<path:object_id>/start-run/", view, name="executions_issue_start_run")] + super().get_urls()

    def extra_detail_context(self, request, obj):
        return {"can_start_run": request.user.has_perm("executions.start_run"),
                "can_reopen": obj.status == "done" and request.user.has_perm("executions.reopen_issue"),
                "runs": list(obj.runs.order_by("-id")[:20])}


@admin.register(Comment)
class CommentAdmin(OpsAdmin):
    list_display = ["issue", "type", "author", "created_at"]
    list_filter = ["type"]
    list_select_related = ["issue"]
    raw_id_fields = ["issue", "source_task", "source_attempt"]


@admin.register(Artifact)
class ArtifactAdmin(OpsAdmin):
    list_display = ["name", "kind", "issue", "run", "size", "created_at"]
    list_filter = ["kind"]
    search_fields = ["name", "=sha256"]
    list_select_related = ["issue", "run"]
    raw_id_fields = ["issue", "run", "attempt"]
    exclude = ["content"]  # raw content is served by the audited API route

    def get_readonly_fields(self, request, obj=None):
        return [f for f in super().get_readonly_fields(request, obj) if f != "content"]


class WorkflowRevisionInline(admin.TabularInline):
    model = WorkflowRevision
    extra = 0
    fields = ["number", "spec", "created_at"]
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


class WorkflowCreateForm(forms.ModelForm):
    spec = forms.JSONField(help_text='{"nodes": [{"key": "build", "type": "agent", "prompt": "...", '
                                     '"depends_on": [], "retry": {"max_task_retries": 1}}]}',
                           widget=forms.Textarea(attrs={"rows": 14, "cols": 90}))

    class Meta:
        model = WorkflowDefinition
        fields = ["name", "description"]

    def clean_spec(self):
        try:
            return workflows.workflow_validate(self.cleaned_data["spec"])
        except ApplicationError as error:
            raise forms.ValidationError(error.message) from None


@admin.register(WorkflowDefinition)
class WorkflowDefinitionAdmin(OpsAdmin):
    list_display = ["name", "description", "created_at"]
    search_fields = ["name"]
    inlines = [WorkflowRevisionInline]
    change_form_template = "admin/executions/workflowdefinition/change_form.html"

    # ops_admin writes workflows; every change is a new immutable revision.
    def has_add_permission(self, request):
        return request.user.has_perm("executions.add_workflowdefinition")

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = WorkflowCreateForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        return ["name", "description", "spec"] if obj is None else super().get_fields(request, obj)

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else super().get_readonly_fields(request, obj)

    def get_inlines(self, request, obj):
        return self.inlines if obj is not None else []

    def save_model(self, request, obj, form, change):
        revision = workflows.workflow_create(name=form.cleaned_data["name"], spec=form.cleaned_data["spec"],
                                             description=form.cleaned_data.get("description", ""), actor=request.user)
        obj.pk = revision.workflow_id
        audit_record(actor=request.user, action="workflow.create", target=f"workflow:{obj.pk}", outcome="created",
                     client="admin")

    def save_related(self, request, form, formsets, change):
        return None

    def log_addition(self, request, obj, message):
        return None  # the audit entry records it

    def get_urls(self):
        view = self.admin_site.admin_view(lambda request, object_id: admin_views.workflow_revise_view(
            self, request, object_id))
        return [path("<path:object_id>/revise/", view, name="executions_workflowdefinition_revise")] + \
            super().get_urls()

    def extra_detail_context(self, request, obj):
        return {"can_revise": request.user.has_perm("executions.add_workflowrevision")}


@admin.register(WorkflowRevision)
class WorkflowRevisionAdmin(OpsAdmin):
    list_display = ["workflow", "number", "created_at"]
    list_select_related = ["workflow"]


@admin.register(Run)
class RunAdmin(OpsAdmin):
    list_display = ["id_short", "issue", "mode", "state_badge", "wait_why", "rerun_of_link", "created_at",
                    "completed_at"]
    list_filter = ["state", "mode", "wait_reason"]
    search_fields = ["issue__title"]
    uuid_search_fields = ("pk", "issue_id", "rerun_of_id")
    list_select_related = ["issue", "rerun_of"]
    raw_id_fields = ["issue", "rerun_of", "parent_run", "parent_node", "workflow_revision"]
    live_streams = ("dashboard",)
    change_form_template = "admin/executions/run/change_form.html"

    def get_list_filter(self, request):
        return [RunAttentionFilter, *super().get_list_filter(request)]  # what the dashboard counts

    detail_select_related = ("issue",)

    @admin.display(description="run", ordering="id")
    def id_short(self, obj):
        return id_cell(obj.pk)

    @admin.display(description="waiting for", ordering="wait_reason")
    def wait_why(self, obj):
        return run_wait_text(obj) or "–"

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj):
        return live_badge(obj, "state")

    @admin.display(description="rerun of")
    def rerun_of_link(self, obj):
        return _link(obj.rerun_of, id_cell(obj.rerun_of_id)) if obj.rerun_of_id else "–"

    def object_stream(self, obj):
        return obj.stream

    def get_urls(self):
        def bind(name):
            return self.admin_site.admin_view(lambda request, object_id: admin_views.run_action_view(
                self, request, object_id, name))

        def record(fmt):
            return self.admin_site.admin_view(lambda request, object_id: troubleshooting.admin_download_view(
                self, request, object_id, fmt))

        task_view = self.admin_site.admin_view(lambda request, object_id, task_id, name:
                                               admin_views.task_action_view(self, request, object_id, task_id, name))
        signal_view = self.admin_site.admin_view(lambda request, object_id: admin_views.run_signal_view(
            self, request, object_id))
        # Task routes first: "<run>/tasks/<task>/cancel/" would otherwise match the run's own "cancel".
        return [
            path("<path:object_id>/tasks/<uuid:task_id>/<str:name>/", task_view, name="executions_run_task_action"),
            path("<path:object_id>/signal/", signal_view, name="executions_run_signal")] + [
            path(f"<path:object_id>/{name}/", bind(name), name=f"executions_run_{name}")
            for name in admin_views.RUN_ACTIONS] + [
            path(f"<path:object_id>/troubleshooting.{fmt}", record(fmt), name=f"executions_run_troubleshooting_{fmt}")
            for fmt in ("md", "json")] + super().get_urls()

    def extra_detail_context(self, request, obj):
        user = request.user
        offered = {"pause": obj.state in {"running", "waiting"}, "resume": obj.state == "paused",
                   "cancel": obj.state not in {"cancelling", "cancelled", "succeeded", "partial_succeeded", "failed"},
                   "rerun": obj.state in {"cancelled", "succeeded", "partial_succeeded", "failed"}}
        return {"graph": selectors.run_graph(obj), "state_badge": live_badge(obj, "state"),
                "wait_text": run_wait_text(obj),
                "reruns": list(obj.reruns.all()[:20]), "evidence": selectors.attempt_evidence(obj),
                "can_signal": obj.state not in states.RUN_TERMINAL and user.has_perm("executions.signal_run"),
                "can_retry_task": user.has_perm("executions.retry_task"),
                "can_cancel_task": user.has_perm("executions.cancel_task"),
                "run_actions": [(name, admin_views.RUN_ACTIONS[name][0]) for name, ok in offered.items()
                                if ok and user.has_perm(f"executions.{name}_run")]}


@admin.register(RunNode)
class RunNodeAdmin(OpsAdmin):
    list_display = ["key", "run", "type", "state_badge", "wait_reason"]
    list_filter = ["state", "type"]
    list_select_related = ["run__issue"]
    raw_id_fields = ["run"]

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj):
        return live_badge(obj, "state")

    def object_stream(self, obj):
        return f"run:{obj.run_id}"

    def timeline_filter(self, obj):
        return {"data__id": str(obj.pk)}


@admin.register(AgentTask)
class AgentTaskAdmin(OpsAdmin):
    list_display = ["id_short", "node", "ordinal", "status_badge", "retry_of", "leader", "wait_reason"]
    list_filter = ["status", "leader"]
    list_select_related = ["node", "retry_of"]
    uuid_search_fields = ("pk", "node_id", "retry_of_id", "session_id")
    raw_id_fields = ["node", "retry_of", "session", "current_attempt"]
    detail_select_related = ("node",)

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj):
        return live_badge(obj)

    def object_stream(self, obj):
        return f"run:{obj.node.run_id}"

    def timeline_filter(self, obj):
        return {"data__id": str(obj.pk)}


@admin.register(Attempt)
class AttemptAdmin(OpsAdmin):
    list_display = ["id_short", "task", "number", "state_badge", "connection", "backend", "started_at", "ended_at"]
    list_filter = ["state", "backend"]
    search_fields = ["provider_session_id__exact"]
    uuid_search_fields = ("pk", "task_id", "session_id", "turn_id")
    list_select_related = ["task", "connection"]
    raw_id_fields = ["task", "connection", "session", "turn"]
    detail_select_related = ("task__node",)
    live_streams = ("dashboard",)

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj):
        return live_badge(obj, "state")

    def object_stream(self, obj):
        return f"run:{obj.task.node.run_id}"

    def timeline_filter(self, obj):
        return {"data__id": str(obj.pk)}


@admin.register(Approval)
class ApprovalAdmin(OpsAdmin):
    list_display = ["id_short", "node", "status_badge", "approver_user", "approver_group", "decided_by", "created_at"]
    list_filter = ["status"]
    list_select_related = ["node", "approver_user", "approver_group", "decided_by"]
    raw_id_fields = ["node", "turn"]

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj):
        return live_badge(obj)
