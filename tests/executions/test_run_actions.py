"""Run control without agents: approvals, signals, review, task retry/cancel, versions (SPEC §4.7)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group
from django.test import Client

from executions import engine
from executions.models import AgentTask, Approval, Issue, Run, RunNode
from executions.workflows import workflow_create
from tests import factories

pytestmark = pytest.mark.django_db


def api(user):
    client = Client()
    client.force_login(user)
    return client


def post(client, url, body=None):
    return client.post(url, data=json.dumps(body or {}), content_type="application/json")


def declared_run(nodes, **start):
    revision = workflow_create(name=factories.unique("wf"), spec={"nodes": nodes})
    issue = factories.make_issue()
    run = engine.run_start(issue_id=issue.pk, mode="declared", workflow_revision_id=revision.pk, **start)
    engine.run_tick_apply(run_id=run.pk)
    return Run.objects.get(pk=run.pk)


def test_approval_node_waits_then_a_decision_completes_the_run_and_review_accepts(operator):
    run = declared_run([{"key": "ship", "type": "approval", "prompt": "Ship it?"}])
    assert (run.state, run.wait_reason) == ("waiting", "approval")
    approval = Approval.objects.get(node__run=run)
    inbox = api(operator).get("/api/v1/inbox").json()
    assert str(approval.pk) in [a["id"] for a in inbox["approvals"]]
    stale = post(api(operator), f"/api/v1/approvals/{approval.pk}/decide",
                 {"decision": "approved", "expected_version": approval.version + 5})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "version_conflict"
    answer = post(api(operator), f"/api/v1/approvals/{approval.pk}/decide",
                  {"decision": "approved", "expected_version": approval.version, "reason": "looks good"})
    assert answer.status_code == 200, answer.content
    engine.run_tick_apply(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == "succeeded"
    issue = Issue.objects.get(pk=run.issue_id)
    assert issue.status == "in_review"
    accepted = post(api(operator), f"/api/v1/issues/{issue.pk}/accept", {"expected_version": issue.version})
    assert accepted.json()["status"] == "done"
    again = post(api(operator), f"/api/v1/issues/{issue.pk}/reject", {})
    assert again.status_code == 409


def test_rejected_approval_fails_the_run_and_review_reject_starts_nothing(operator):
    run = declared_run([{"key": "ship", "type": "approval"}])
    approval = Approval.objects.get(node__run=run)
    post(api(operator), f"/api/v1/approvals/{approval.pk}/decide", {"decision": "rejected", "reason": "no"})
    engine.run_tick_apply(run_id=run.pk)
    assert Run.objects.get(pk=run.pk).state == "failed"
    issue = factories.make_issue(status="in_review")
    runs_before = Run.objects.count()
    rejected = post(api(operator), f"/api/v1/issues/{issue.pk}/reject", {"reason": "missing tests"})
    assert rejected.json()["status"] == "in_progress"
    assert Run.objects.count() == runs_before
    assert issue.comments.get().body == "missing tests"


def test_designated_approver_only(operator):
    group = Group.objects.create(name="release-managers")
    run = declared_run([{"key": "ship", "type": "approval", "approver_group": "release-managers"}])
    approval = Approval.objects.get(node__run=run)
    refused = post(api(operator), f"/api/v1/approvals/{approval.pk}/decide", {"decision": "approved"})
    assert refused.status_code == 403
    operator.groups.add(group)
    assert post(api(operator), f"/api/v1/approvals/{approval.pk}/decide",
                {"decision": "approved"}).status_code == 200


def test_signal_node_continues_on_its_signal(operator):
    run = declared_run([{"key": "wait-for-deploy", "type": "signal", "signal": "deployed"},
                        {"key": "after", "type": "approval", "depends_on": ["wait-for-deploy"]}])
    assert run.wait_reason == "signal"
    wrong = post(api(operator), f"/api/v1/runs/{run.pk}/signals/other").json()
    assert wrong["changed"] is False
    right = post(api(operator), f"/api/v1/runs/{run.pk}/signals/deployed").json()
    assert right["nodes"] == ["wait-for-deploy"]
    engine.run_tick_apply(run_id=run.pk)
    assert RunNode.objects.get(run=run, key="after").state == "waiting"  # the next node's approval


def test_without_a_worker_the_run_waits_and_task_cancel_then_retry(operator):
    issue = factories.make_issue()
    run = engine.run_start(issue_id=issue.pk, mode="direct", input={"prompt": "@outcome succeeded"},
                           target={"backend": "codex"})
    engine.run_tick_apply(run_id=run.pk)
    run.refresh_from_db()
    assert (run.state, run.wait_reason) == ("waiting", "no_worker")
    assert run.wait_detail["unblock"]
    task = AgentTask.objects.get(node__run=run)
    assert post(api(operator), f"/api/v1/tasks/{task.pk}/cancel").json()["status"] == "cancelled"
    engine.run_tick_apply(run_id=run.pk)
    node = RunNode.objects.get(run=run)
    assert (node.state, node.wait_reason) == ("waiting", "blocked")
    assert AgentTask.objects.filter(node=node).count() == 1  # nothing recreated it behind the operator's back
    retried = post(api(operator), f"/api/v1/tasks/{task.pk}/retry").json()
    new = AgentTask.objects.get(pk=retried["task"])
    assert new.retry_of_id == task.pk and new.ordinal == 2


def test_workflow_validation_errors_are_clear(ops_admin_user):
    client = api(ops_admin_user)
    cases = {
        "unknown type": [{"key": "a", "type": "robot"}],
        "depends on unknown": [{"key": "a", "depends_on": ["zz"]}],
        "cycle": [{"key": "a", "depends_on": ["b"]}, {"key": "b", "depends_on": ["a"]}],
        "max_task_retries": [{"key": "a", "retry": {"max_task_retries": -1}}],
    }
    for words, nodes in cases.items():
        response = post(client, "/api/v1/workflows", {"name": factories.unique("wf"), "spec": {"nodes": nodes}})
        assert response.status_code == 400, words
        assert words in response.json()["error"]["message"], (words, response.json())


def test_viewer_cannot_act_on_runs(viewer):
    run = declared_run([{"key": "ship", "type": "approval"}])
    assert post(api(viewer), f"/api/v1/runs/{run.pk}/pause").status_code == 403
    assert post(api(viewer), "/api/v1/runs", {"issue": str(run.issue_id), "mode": "direct",
                                               "input": {"prompt": "x"}}).status_code == 403
