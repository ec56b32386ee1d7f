"""Run action pages of the admin (SPEC §4.7): confirmation first, then the same service as the API."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse

from chorus_site.errors import ApplicationError
from sessions_app.admin_views import NOTHING_UNDONE
from sessions_app.models import Connection

from . import actions, engine
from .models import WorkflowRevision

RUN_ACTIONS = {
    "pause": ("Pause run", "No new node is dispatched; attempts already running go on (pausing freezes no process).",
              actions.run_pause),
    "resume": ("Resume run", "Dispatch continues where it stopped.", actions.run_resume),
    "cancel": ("Cancel run", "Every active attempt is interrupted (graceful stop, then its process tree is killed); "
                         "the run becomes cancelled when all are finished. The issue is not accepted.",
               actions.run_cancel),
    "rerun": ("Rerun", "A new run of the same issue, mode, revision and input, linked with rerun_of. "
                       "This run and its history stay as they are.", actions.run_rerun),
}


def _page(admin, request, obj, context):
    return TemplateResponse(request, "admin/chorus/action_confirm.html", {
        **admin.admin_site.each_context(request), "opts": admin.model._meta, "original": obj,
        "nothing_undone": NOTHING_UNDONE, "fields": [], **context})





def run_action_view(admin, request, object_id, name):
    label, meaning, service = RUN_ACTIONS[name]
    if not request.user.has_perm(f"executions.{name}_run"):
        raise PermissionDenied
    run = admin.get_object(request, object_id)
    if run is None:
        raise PermissionDenied
    url = reverse("admin:executions_run_change", args=[run.pk])
    if request.method == "POST":
        kwargs = {} if name == "rerun" else {"expected_version": run.version}
        try:
            answer = service(actor=request.user, run_id=run.pk, client="admin",
                             reason=request.POST.get("reason") or None, **kwargs)
        except ApplicationError as error:
            messages.error(request, f"Refused ({error.code}): {error.message}")
            return HttpResponseRedirect(url)
        if not answer.get("changed", True):
            messages.info(request, "Nothing to do: that already holds.")
        elif name == "rerun":
            messages.success(request, "Rerun started.")
            return HttpResponseRedirect(reverse("admin:executions_run_change", args=[answer["run"]]))
        else:
            messages.success(request, f"{label}: the run is {answer['state']}.")
        return HttpResponseRedirect(url)
    return _page(admin, request, run, {
        "title": f"{label}: {run}?", "action_label": label, "danger": name == "cancel",
        "touched": [f"Run {run.pk} of “{run.issue}” ({run.state})", meaning]})


def issue_start_run_view(admin, request, object_id):
    if not request.user.has_perm("executions.start_run"):
        raise PermissionDenied
    issue = admin.get_object(request, object_id)
    if issue is None:
        raise PermissionDenied
    values = request.POST if request.method == "POST" else {"mode": "direct"}
    if request.method == "POST":
        target = {"connection": values.get("connection")} if values.get("connection") else {}
        try:
            run = engine.run_start(
                issue_id=issue.pk, mode=values.get("mode", "direct"), actor=request.user, client="admin",
                reason=values.get("reason") or None,
                workflow_revision_id=values.get("workflow_revision") or None, target=target,
                input={"prompt": values.get("prompt", "")} if values.get("prompt") else {})
        except ApplicationError as error:
            messages.error(request, f"Refused ({error.code}): {error.message}")
        else:
            messages.success(request, "Run started.")
            return HttpResponseRedirect(reverse("admin:executions_run_change", args=[run.pk]))
    fields = [("mode", "Mode", "mode"), ("workflow_revision", "Workflow revision (declared)", "revision"),
              ("prompt", "Prompt (direct and adaptive; for declared runs: input.prompt)", "textarea"),
              ("connection", "Connection", "any_connection")]
    return _page(admin, request, issue, {
        "title": f"Start a run of “{issue}”", "action_label": "Start run",
        "touched": ["A new run: each agent node becomes a task with its own session; every attempt is a real "
                    "turn on a daemon. The issue moves to in progress; acceptance stays a separate act."],
        "fields": [(n, label, kind, values.get(n, "")) for n, label, kind in fields],
        "connections": Connection.objects.order_by("name"),
        "revisions": WorkflowRevision.objects.select_related("workflow").order_by("workflow__name", "-number"),
    })


def issue_reopen_view(admin, request, object_id):
    if not request.user.has_perm("executions.reopen_issue"):
        raise PermissionDenied
    issue = admin.get_object(request, object_id)
    if issue is None:
        raise PermissionDenied
    url = reverse("admin:executions_issue_change", args=[issue.pk])
    if request.method == "POST":
        try:
            answer = actions.issue_reopen(actor=request.user, issue_id=issue.pk, client="admin",
                                          reason=request.POST.get("reason") or None, expected_version=issue.version)
        except ApplicationError as error:
            messages.error(request, f"Refused ({error.code}): {error.message}")
        else:
            messages.success(request, "Reopened: the issue is in progress." if answer["changed"]
                             else "Nothing to do: the issue is already in progress.")
        return HttpResponseRedirect(url)
    return _page(admin, request, issue, {
        "title": f"Reopen “{issue}”?", "action_label": "Reopen",
        "touched": [f"Issue “{issue}” ({issue.status}) goes back to in progress; no run starts by itself. "
                    "Its runs stay as they are and can then be rerun."]})


TASK_ACTIONS = {
    "retry": ("Retry task", "A new task for the node, linked with retry_of; the finished task stays as it was.",
              "executions.retry_task", actions.task_retry),
    "cancel": ("Cancel task", "Its active attempt is interrupted (verified stop); the node waits for a retry.",
               "executions.cancel_task", actions.task_cancel),
}


def task_action_view(admin, request, object_id, task_id, name):
    from .models import AgentTask

    if name not in TASK_ACTIONS:
        raise PermissionDenied
    label, meaning, perm, service = TASK_ACTIONS[name]
    if not request.user.has_perm(perm):
        raise PermissionDenied
    run = admin.get_object(request, object_id)
    task = AgentTask.objects.select_related("node").filter(pk=task_id, node__run=run).first() if run else None
    if task is None:
        raise PermissionDenied
    url = reverse("admin:executions_run_change", args=[run.pk])
    if request.method == "POST":
        try:
            answer = service(actor=request.user, task_id=task.pk, client="admin",
                             reason=request.POST.get("reason") or None)
        except ApplicationError as error:
            messages.error(request, f"Refused ({error.code}): {error.message}")
        else:
            messages.success(request, f"{label}: done." if answer.get("changed", True) else "Nothing to do.")
        return HttpResponseRedirect(url)
    return _page(admin, request, run, {
        "title": f"{label}: task {task.ordinal} of {task.node.key}?", "action_label": label,
        "danger": name == "cancel", "touched": [f"Task {task.pk} ({task.status}) of node {task.node.key}", meaning]})


def run_signal_view(admin, request, object_id):
    if not request.user.has_perm("executions.signal_run"):
        raise PermissionDenied
    run = admin.get_object(request, object_id)
    if run is None:
        raise PermissionDenied
    url = reverse("admin:executions_run_change", args=[run.pk])
    waiting = [n.wait_detail.get("signal") for n in run.nodes.filter(type="signal", state="waiting")]
    if request.method == "POST":
        try:
            answer = actions.run_signal(actor=request.user, run_id=run.pk, name=request.POST.get("name", "").strip(),
                                        client="admin", reason=request.POST.get("reason") or None)
        except ApplicationError as error:
            messages.error(request, f"Refused ({error.code}): {error.message}")
        else:
            messages.success(request, f"Signal delivered to {', '.join(answer['nodes'])}." if answer["nodes"]
                             else "No node was waiting for that signal.")
        return HttpResponseRedirect(url)
    return _page(admin, request, run, {
        "title": f"Deliver a signal to {run}", "action_label": "Deliver signal",
        "touched": [f"Nodes waiting for it continue. Waiting now for: {', '.join(waiting) or 'no signal'}."],
        "fields": [("name", "Signal name", "text", waiting[0] if waiting else "")]})


def inbox_view(admin, request):
    """Review items and approvals for the signed-in operator, decided in place."""
    from . import selectors

    if not request.user.has_perm("executions.view_issue"):
        raise PermissionDenied
    if request.method == "POST":
        kind, object_id = request.POST.get("kind"), request.POST.get("id")
        version = request.POST.get("version")
        version = int(version) if version and version.isdigit() else None
        reason = request.POST.get("reason") or None
        try:
            if kind == "issue":
                perm = "executions.accept_issue" if request.POST.get("decision") == "accept" else "executions.reject_issue"
                if not request.user.has_perm(perm):
                    raise PermissionDenied
                actions.issue_review(actor=request.user, issue_id=object_id, client="admin", reason=reason,
                                     accept=request.POST.get("decision") == "accept", expected_version=version)
            elif kind == "approval":
                if not request.user.has_perm("executions.decide_approval"):
                    raise PermissionDenied
                actions.approval_decide(actor=request.user, approval_id=object_id, client="admin", reason=reason,
                                        decision=request.POST.get("decision", ""), expected_version=version)
            messages.success(request, "Decision recorded.")
        except ApplicationError as error:
            messages.error(request, f"Refused ({error.code}): {error.message}")
        return HttpResponseRedirect(reverse("admin:executions_issue_inbox"))
    return TemplateResponse(request, "admin/executions/inbox.html", {
        **admin.admin_site.each_context(request), "opts": admin.model._meta, "title": "Inbox",
        "inbox": selectors.inbox_for(request.user),
        "can_review": request.user.has_perm("executions.accept_issue"),
        "can_decide": request.user.has_perm("executions.decide_approval")})


def workflow_revise_view(admin, request, object_id):
    """A new immutable revision of a workflow, validated before it is stored."""
    import json

    from . import workflows

    if not request.user.has_perm("executions.add_workflowrevision"):
        raise PermissionDenied
    workflow = admin.get_object(request, object_id)
    if workflow is None:
        raise PermissionDenied
    latest = workflow.revisions.order_by("-number").first()
    text = request.POST.get("spec") if request.method == "POST" else json.dumps(latest.spec if latest else
                                                                                 {"nodes": []}, indent=2)
    if request.method == "POST":
        try:
            revision = workflows.workflow_revise(workflow_id=workflow.pk, spec=json.loads(text or ""),
                                                 actor=request.user)
        except json.JSONDecodeError as error:
            messages.error(request, f"Not JSON: {error}")
        except ApplicationError as error:
            messages.error(request, f"Refused: {error.message}")
        else:
            from chorus_site.audit import audit_record

            audit_record(actor=request.user, action="workflow.revise", target=f"workflow:{workflow.pk}",
                         outcome=f"revision {revision.number}", client="admin")
            messages.success(request, f"Revision {revision.number} created; earlier revisions stay as they were.")
            return HttpResponseRedirect(reverse("admin:executions_workflowdefinition_change", args=[workflow.pk]))
    return _page(admin, request, workflow, {
        "title": f"New revision of {workflow.name}", "action_label": "Create revision",
        "touched": ["A new immutable revision; runs already started keep the revision they were started with."],
        "fields": [("spec", "Workflow (JSON)", "textarea", text)]})
