"""Agents talk back with their attempt's task token, and only about their own work (SPEC §5)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from executions.models import Artifact, Attempt, Comment
from executions.task_tokens import attempt_for_task_token, task_token_for
from tests import factories

pytestmark = pytest.mark.django_db


def agent_post(token, url, body):
    return Client().post(url, data=json.dumps(body), content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {token}")


def test_outcome_only_for_its_own_attempt_and_waiting_needs_a_dependency():
    _run, _node, _task, attempt = factories.make_run_graph()
    _r2, _n2, _t2, other = factories.make_run_graph()
    token = task_token_for(attempt)
    assert agent_post(token, f"/api/v1/attempts/{other.pk}/outcome", {"intent": "succeeded"}).status_code == 403
    assert agent_post(token, f"/api/v1/attempts/{attempt.pk}/outcome", {"intent": "waiting"}).status_code == 400
    ok = agent_post(token, f"/api/v1/attempts/{attempt.pk}/outcome",
                    {"intent": "waiting", "ref": str(other.task.node.run.issue_id), "summary": "needs the API"})
    assert ok.status_code == 200
    assert Attempt.objects.get(pk=attempt.pk).outcome["intent"] == "waiting"
    assert agent_post("cht_forged", f"/api/v1/attempts/{attempt.pk}/outcome",
                      {"intent": "succeeded"}).status_code == 401


def test_agent_comments_and_artifacts_stay_in_their_own_issue():
    run, _node, _task, attempt = factories.make_run_graph()
    token = task_token_for(attempt)
    posted = agent_post(token, f"/api/v1/issues/{run.issue_id}/comments", {"body": "progress: 50%", "type": "progress"})
    assert posted.status_code == 201
    comment = Comment.objects.get(issue=run.issue)
    assert comment.source_attempt_id == attempt.pk and comment.author.startswith("agent:")
    other_issue = factories.make_issue()
    assert agent_post(token, f"/api/v1/issues/{other_issue.pk}/comments", {"body": "x"}).status_code == 403
    artifact = agent_post(token, "/api/v1/artifacts", {"kind": "report", "name": "r.md", "content": "# done"})
    assert artifact.status_code == 201
    assert Artifact.objects.get(name="r.md").attempt_id == attempt.pk


def test_only_the_adaptive_lead_adds_members():
    run, node, task, attempt = factories.make_run_graph()
    response = agent_post(task_token_for(attempt), f"/api/v1/runs/{run.pk}/nodes",
                          {"nodes": [{"key": "docs", "prompt": "write docs"}]})
    assert response.status_code == 403


def test_tokens_expire_with_their_attempt():
    from datetime import timedelta

    from django.utils import timezone

    _run, _node, _task, attempt = factories.make_run_graph()
    token = task_token_for(attempt)
    assert attempt_for_task_token(token).pk == attempt.pk
    Attempt.objects.filter(pk=attempt.pk).update(ended_at=timezone.now() - timedelta(hours=1))
    assert attempt_for_task_token(token) is None


def test_operators_comment_with_their_own_permission(viewer, operator):
    issue = factories.make_issue()
    for user, expected in ((viewer, 403), (operator, 201)):
        client = Client()
        client.force_login(user)
        response = client.post(f"/api/v1/issues/{issue.pk}/comments", data=json.dumps({"body": "note"}),
                               content_type="application/json")
        assert response.status_code == expected
