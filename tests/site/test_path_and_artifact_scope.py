"""Scope checks the portal makes itself (issue 8 item 10).

A session's directory must lie inside its connection's roots after ``..`` is resolved, and an
artifact may not link a run or attempt of another issue.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client
from django.utils import timezone

from executions.models import Artifact
from sessions_app.models import Connection, Session
from sessions_app.services import cwd_allowed
from tests import factories

pytestmark = pytest.mark.django_db


def _post(user, url, body):
    client = Client()
    client.force_login(user)
    return client.post(url, data=json.dumps(body), content_type="application/json")


@pytest.mark.parametrize("cwd, allowed", [
    ("/srv/work", True), ("/srv/work/app", True), ("/srv/work/./app/../lib", True), ("/srv/work/", True),
    ("/srv/work/../../etc", False), ("/srv/work/..", False), ("/srv/work/app/../../other", False),
    ("/srv/workshop", False), ("srv/work/app", False), ("/srv/work/../work2", False),
])
def test_cwd_allowed_resolves_dot_dot_first(cwd, allowed):
    connection = factories.make_connection(cwds=["/srv/work"])
    assert cwd_allowed(connection, cwd) is allowed


def test_a_session_that_climbs_out_of_the_roots_is_refused_and_not_stored(operator):
    connection = factories.make_connection(cwds=["/srv/work"])
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    response = _post(operator, "/api/v1/sessions",
                     {"connection": str(connection.pk), "cwd": "/srv/work/../../etc", "prompt": "cat passwd"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_request"
    assert not Session.objects.filter(connection=connection).exists()


def test_an_artifact_cannot_link_a_run_or_attempt_of_another_issue(operator):
    run_a, _node, _task, attempt_a = factories.make_run_graph()
    run_b, _node, _task, attempt_b = factories.make_run_graph()
    base = {"kind": "report", "name": "r.md", "content": "# r", "issue": str(run_a.issue_id)}
    refused = [
        {**base, "run": str(run_b.pk)},
        {**base, "run": str(run_a.pk), "attempt": str(attempt_b.pk)},
        {**base, "attempt": str(attempt_b.pk)},
    ]
    for body in refused:
        response = _post(operator, "/api/v1/artifacts", body)
        assert response.status_code == 400, body
        assert response.json()["error"]["code"] == "bad_request"
    assert not Artifact.objects.exists()
    ok = _post(operator, "/api/v1/artifacts", {**base, "run": str(run_a.pk), "attempt": str(attempt_a.pk)})
    assert ok.status_code == 201
    assert Artifact.objects.get().run_id == run_a.pk
