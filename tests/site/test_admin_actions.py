"""Operator action pages in the admin: confirmation first, then the service; permissions per role."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from chorus_site.models import AuditEntry
from sessions_app import services
from sessions_app.models import Connection, Turn
from tests import factories

pytestmark = pytest.mark.django_db


def client_for(user):
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def live_connection():
    connection = factories.make_connection(cwds=["/srv/work"])
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    connection.refresh_from_db()
    return connection


def test_interrupt_page_confirms_then_acts_and_audits(operator, viewer, live_connection):
    session = factories.make_session(connection=live_connection)
    turn = factories.make_turn(session=session)
    url = reverse("admin:sessions_app_turn_interrupt", args=[turn.pk])
    assert client_for(viewer).get(url).status_code == 403
    page = client_for(operator).get(url)
    assert page.status_code == 200
    assert b"What will be touched" in page.content and b"Stopping never undoes work" in page.content
    done = client_for(operator).post(url, {"reason": "not needed"})
    assert done.status_code == 302
    turn.refresh_from_db()
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    entry = AuditEntry.objects.get(action="turn.interrupt", target=f"turn:{turn.pk}")
    assert (entry.client, entry.reason) == ("admin", "not needed")


def test_turn_page_shows_buttons_only_to_operators(operator, viewer, live_connection):
    turn = factories.make_turn(session=factories.make_session(connection=live_connection))
    services.turn_set_status(turn_id=turn.pk, status="running")
    url = reverse("admin:sessions_app_turn_change", args=[turn.pk])
    assert b"chorus-interrupt" in client_for(operator).get(url).content
    assert b"chorus-interrupt" not in client_for(viewer).get(url).content


def test_start_page_keeps_what_was_typed_when_refused(operator, live_connection):
    previous = factories.make_turn(session=factories.make_session(connection=live_connection, cwd="/srv/work"))
    services.turn_set_status(turn_id=previous.pk, status="running")
    services.turn_set_status(turn_id=previous.pk, status="interrupted", reason="user", changes={"files": ["a.py"]})
    url = reverse("admin:sessions_app_connection_start", args=[live_connection.pk])
    client = client_for(operator)
    refused = client.post(url, {"cwd": "/srv/work", "prompt": "my long instruction", "title": "T"})
    assert refused.status_code == 200
    assert b"my long instruction" in refused.content and b"a.py" in refused.content
    started = client.post(url, {"cwd": "/srv/work", "prompt": "my long instruction", "acknowledge_changes": "1"})
    assert started.status_code == 302
    assert Turn.objects.filter(prompt="my long instruction").count() == 1


def test_resume_page_shows_the_preflight_and_blocks_offline(operator, live_connection):
    turn = factories.make_turn(session=factories.make_session(connection=live_connection))
    services.turn_set_status(turn_id=turn.pk, status="running")
    services.turn_set_status(turn_id=turn.pk, status="interrupted", reason="user")
    url = reverse("admin:sessions_app_session_resume", args=[turn.session_id])
    page = client_for(operator).get(url)
    assert b'id="chorus-preflight"' in page.content and b"chorus-confirm" in page.content
    Connection.objects.filter(pk=live_connection.pk).update(status="offline")
    blocked = client_for(operator).get(url)
    assert b'id="chorus-blocked"' in blocked.content and b"restore the daemon" in blocked.content
    assert b"chorus-confirm" not in blocked.content


def test_bulk_interrupt_confirms_then_reports_done_and_refused(operator, live_connection):
    session = factories.make_session(connection=live_connection)
    pending = factories.make_turn(session=session)
    ended = factories.make_turn(session=factories.make_session(connection=live_connection))
    services.turn_set_status(turn_id=ended.pk, status="running")
    services.turn_set_status(turn_id=ended.pk, status="ended")
    url = reverse("admin:sessions_app_turn_changelist")
    data = {"action": "interrupt_selected", "_selected_action": [pending.pk, ended.pk]}
    confirm = client_for(operator).post(url, data)
    assert confirm.status_code == 200 and b"Stopping never undoes work" in confirm.content
    pending.refresh_from_db()
    assert pending.status == "pending"  # nothing happens before the confirmation
    result = client_for(operator).post(url, {**data, "confirmed": "yes"}, follow=True)
    text = result.content.decode()
    assert "1 done, 0 already so, 1 refused" in text
    pending.refresh_from_db()
    assert pending.status == "interrupted"


def test_viewer_has_no_bulk_actions(viewer):
    page = client_for(viewer).get(reverse("admin:sessions_app_turn_changelist"))
    assert b"interrupt_selected" not in page.content


def test_issue_page_starts_a_run_and_the_run_page_pauses_and_cancels_it(operator, viewer):
    issue = factories.make_issue(title="Docs")
    start_url = reverse("admin:executions_issue_start_run", args=[issue.pk])
    assert client_for(viewer).get(start_url).status_code == 403
    page = client_for(operator).get(start_url)
    assert page.status_code == 200 and b'id="id_mode"' in page.content
    refused = client_for(operator).post(start_url, {"mode": "direct", "prompt": ""})
    assert refused.status_code == 200 and b"input.prompt" in refused.content  # explained, form kept
    started = client_for(operator).post(start_url, {"mode": "direct", "prompt": "@outcome succeeded"})
    assert started.status_code == 302
    from executions.models import Run

    run = Run.objects.get(issue=issue)
    detail = client_for(operator).get(reverse("admin:executions_run_change", args=[run.pk])).content
    assert b"chorus-run-pause" in detail and b"chorus-run-cancel" in detail and b"chorus-run-rerun" not in detail
    assert b"chorus-run-pause" not in client_for(viewer).get(
        reverse("admin:executions_run_change", args=[run.pk])).content
    pause = reverse("admin:executions_run_pause", args=[run.pk])
    assert b"freezes no process" in client_for(operator).get(pause).content
    client_for(operator).post(pause)
    run.refresh_from_db()
    assert run.state == "paused"
    client_for(operator).post(reverse("admin:executions_run_cancel", args=[run.pk]))
    run.refresh_from_db()
    assert run.state == "cancelling"
    assert AuditEntry.objects.filter(target=f"run:{run.pk}", client="admin").count() == 3


def test_inbox_decides_reviews_and_approvals_in_place(operator, viewer):
    from executions import engine
    from executions.models import Approval, Issue
    from executions.workflows import workflow_create

    issue = factories.make_issue(status="in_review", title="Ready for review")
    revision = workflow_create(name="inbox-wf", spec={"nodes": [{"key": "ship", "type": "approval",
                                                                 "prompt": "Ship v2?"}]})
    run = engine.run_start(issue_id=factories.make_issue().pk, mode="declared", workflow_revision_id=revision.pk)
    engine.run_tick_apply(run_id=run.pk)
    url = reverse("admin:executions_issue_inbox")
    page = client_for(operator).get(url).content.decode()
    assert "Ready for review" in page and "Ship v2?" in page
    assert 'value="accept"' not in client_for(viewer).get(url).content.decode()
    client_for(operator).post(url, {"kind": "issue", "id": issue.pk, "decision": "accept",
                                    "version": issue.version})
    assert Issue.objects.get(pk=issue.pk).status == "done"
    approval = Approval.objects.get(node__run=run)
    client_for(operator).post(url, {"kind": "approval", "id": approval.pk, "decision": "approved",
                                    "version": approval.version})
    assert Approval.objects.get(pk=approval.pk).status == "approved"
    denied = client_for(viewer).post(url, {"kind": "approval", "id": approval.pk, "decision": "rejected"})
    assert denied.status_code == 403


def test_run_page_shows_evidence_and_task_actions(operator):
    from executions.models import Attempt

    run, node, task, attempt = factories.make_run_graph(run_state="running")
    Attempt.objects.filter(pk=attempt.pk).update(outcome={"intent": "failed", "summary": "tests red"})
    page = client_for(operator).get(reverse("admin:executions_run_change", args=[run.pk])).content.decode()
    assert 'id="chorus-evidence"' in page and "tests red" in page and "not delivered" in page
    cancel = reverse("admin:executions_run_task_action", args=[run.pk, task.pk, "cancel"])
    assert cancel in page
    assert b"Stopping never undoes work" in client_for(operator).get(cancel).content


def test_ops_admin_writes_workflows_and_revisions_in_the_admin(ops_admin_user, operator):
    import json

    from executions.models import WorkflowDefinition

    add = reverse("admin:executions_workflowdefinition_add")
    assert client_for(operator).get(add).status_code == 403
    cycle = {"nodes": [{"key": "a", "depends_on": ["b"]}, {"key": "b", "depends_on": ["a"]}]}
    refused = client_for(ops_admin_user).post(add, {"name": "loop", "description": "", "spec": json.dumps(cycle)})
    assert refused.status_code == 200 and b"dependency cycle" in refused.content
    assert not WorkflowDefinition.objects.filter(name="loop").exists()
    good = {"nodes": [{"key": "build", "type": "agent", "prompt": "@outcome succeeded"}]}
    created = client_for(ops_admin_user).post(add, {"name": "build", "description": "d", "spec": json.dumps(good)})
    assert created.status_code == 302
    workflow = WorkflowDefinition.objects.get(name="build")
    assert workflow.revisions.get().number == 1
    revise = reverse("admin:executions_workflowdefinition_revise", args=[workflow.pk])
    good["nodes"].append({"key": "test", "depends_on": ["build"], "prompt": "@outcome succeeded"})
    client_for(ops_admin_user).post(revise, {"spec": json.dumps(good)})
    assert sorted(workflow.revisions.values_list("number", flat=True)) == [1, 2]
    assert len(workflow.revisions.get(number=1).spec["nodes"]) == 1  # the first revision is unchanged
