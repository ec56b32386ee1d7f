"""Reopening a done issue (issue 7 item 15): the refusal of a rerun names it, and it exists in the API
and the admin, for ops_operator, audited, with expected_version; done → in_progress (SPEC §3.2)."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from django.urls import reverse

from chorus_site.models import AuditEntry
from executions import actions, engine
from executions.models import Issue, Run
from tests import factories
from tests.executions.test_engine_fallback import finish_with, live

pytestmark = pytest.mark.django_db


def api(user):
    client = Client()
    client.force_login(user)
    return client


def post(client, url, body=None):
    return client.post(url, data=json.dumps(body or {}), content_type="application/json")


def succeeded_run_of_a_done_issue():
    connection = live(factories.make_connection(cwds=["/srv/a"]))
    issue = factories.make_issue(completion_policy="automatic")
    run = engine.run_start(issue_id=issue.pk, mode="direct", input={"prompt": "@outcome succeeded"},
                           target={"connection": str(connection.pk)})
    engine.run_tick_apply(run_id=run.pk)
    from executions.models import Attempt

    finish_with(connection, Attempt.objects.get(task__node__run=run), "succeeded")
    run.refresh_from_db()
    issue.refresh_from_db()
    assert (run.state, issue.status) == ("succeeded", "done")
    return run, issue


def test_a_rerun_refused_for_a_done_issue_goes_through_after_reopen(operator):
    run, issue = succeeded_run_of_a_done_issue()
    refused = post(api(operator), f"/api/v1/runs/{run.pk}/rerun")
    assert refused.status_code == 409
    assert f"/api/v1/issues/{issue.pk}/reopen" in refused.json()["error"]["message"]
    stale = post(api(operator), f"/api/v1/issues/{issue.pk}/reopen", {"expected_version": issue.version + 3})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "version_conflict"
    answer = post(api(operator), f"/api/v1/issues/{issue.pk}/reopen",
                  {"expected_version": issue.version, "reason": "the fix regressed"})
    assert answer.status_code == 200, answer.content
    assert answer.json()["changed"] is True and answer.json()["status"] == "in_progress"
    assert AuditEntry.objects.filter(action="issue.reopen", target=f"issue:{issue.pk}", actor=operator.username,
                                     outcome="in_progress").count() == 1
    assert Issue.objects.get(pk=issue.pk).comments.get().body == "the fix regressed"
    again = post(api(operator), f"/api/v1/issues/{issue.pk}/reopen").json()
    assert again["changed"] is False
    rerun = post(api(operator), f"/api/v1/runs/{run.pk}/rerun")
    assert rerun.status_code == 200, rerun.content
    assert Run.objects.get(pk=rerun.json()["run"]).rerun_of_id == run.pk


def test_only_a_done_issue_is_reopened_and_only_by_an_operator(operator, viewer):
    backlog = factories.make_issue()
    refused = post(api(operator), f"/api/v1/issues/{backlog.pk}/reopen")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "invalid_transition"
    done = factories.make_issue(status="done")
    assert post(api(viewer), f"/api/v1/issues/{done.pk}/reopen").status_code == 403
    assert Issue.objects.get(pk=done.pk).status == "done"
    cancelled = factories.make_issue(status="cancelled")
    with pytest.raises(Exception) as final:
        engine.run_start(issue_id=cancelled.pk, mode="direct", input={"prompt": "x"})
    assert "reopen" not in final.value.message and "new issue" in final.value.message


def test_the_admin_offers_reopen_on_a_done_issue(operator, viewer):
    issue = factories.make_issue(status="done")
    page = reverse("admin:executions_issue_change", args=[issue.pk])
    url = reverse("admin:executions_issue_reopen", args=[issue.pk])
    assert b"chorus-reopen" in api(operator).get(page).content
    assert b"chorus-reopen" not in api(viewer).get(page).content
    assert api(viewer).post(url, {"reason": "x"}).status_code == 403
    confirm = api(operator).get(url)
    assert confirm.status_code == 200 and b"in progress" in confirm.content
    assert Issue.objects.get(pk=issue.pk).status == "done"  # the confirmation page changes nothing
    api(operator).post(url, {"reason": "again"})
    assert Issue.objects.get(pk=issue.pk).status == "in_progress"
    assert AuditEntry.objects.get(action="issue.reopen", target=f"issue:{issue.pk}").client == "admin"
    assert b"chorus-reopen" not in api(operator).get(page).content  # no longer done


def test_a_message_to_an_ended_session_names_the_session_it_was_handed_to(operator):
    from sessions_app import actions as session_actions
    from sessions_app.models import Connection, Session
    from django.utils import timezone

    connection = factories.make_connection(cwds=["/srv/work"])
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    old = factories.make_session(connection=connection)
    answer = session_actions.session_handoff(actor=operator, session_id=old.pk, context="go on")
    refused = post(api(operator), f"/api/v1/sessions/{old.pk}/messages", {"prompt": "hello"})
    assert refused.status_code == 409
    assert answer["session"] in refused.json()["error"]["message"]
    assert "hand it off" not in refused.json()["error"]["message"]
    assert Session.objects.get(pk=old.pk).status == "ended"
