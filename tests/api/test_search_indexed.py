"""The API's search box reads indexes only (issue 9 item 4): ids exactly, substrings of 3+
characters through trigram indexes (executions/migrations/0005_search_indexes.py).

At 1M sessions a substring search read every row (1 s a search); here the tables are small, so
the planner is told to avoid reading whole tables or primary keys and each search's plan must
still name its trigram index.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client

from chorus_site.tokens import token_create
from executions.filters import IssueFilter, RunFilter
from executions.models import Issue, Run
from sessions_app.filters import SessionFilter
from sessions_app.models import Session
from tests import factories

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]


def ids(client: Client, path: str) -> list[str]:
    response = client.get(path)
    assert response.status_code == 200, response.content
    return [item["id"] for item in response.json()["items"]]


@pytest.fixture
def client(viewer) -> Client:
    _token, raw = token_create(user=viewer, name="search")
    return Client(HTTP_AUTHORIZATION=f"Bearer {raw}")


def test_sessions_are_found_by_id_idea_key_and_substrings(client):
    a = factories.make_session(idea_key="release-notes-42")
    a.title = "Write the release notes"
    a.save(update_fields=["title"])
    b = factories.make_session(idea_key="ab")
    assert ids(client, f"/api/v1/sessions?q={a.id}") == [str(a.id)]
    assert ids(client, "/api/v1/sessions?q=release-notes-42") == [str(a.id)]
    assert ids(client, "/api/v1/sessions?q=NOTES") == [str(a.id)]  # a substring of the title, any case
    assert ids(client, "/api/v1/sessions?q=ab") == [str(b.id)]  # short: the exact idea key only
    assert ids(client, "/api/v1/sessions?q=no") == []


def test_runs_and_issues_are_found_by_id_and_substrings(client):
    issue = factories.make_issue(title="Flaky checkout on Tuesdays")
    run = factories.make_run(issue=issue)
    failed = factories.make_run(issue=factories.make_issue(title="Other"), failure_message="disk quota exceeded")
    assert ids(client, "/api/v1/issues?q=checkout") == [str(issue.id)]
    assert ids(client, f"/api/v1/issues?q={issue.id}") == [str(issue.id)]
    assert ids(client, "/api/v1/runs?q=tuesday") == [str(run.id)]
    assert ids(client, "/api/v1/runs?q=QUOTA") == [str(failed.id)]
    assert ids(client, f"/api/v1/runs?q={issue.id}") == [str(run.id)]  # the runs of an issue by its id
    assert ids(client, "/api/v1/runs?q=fl") == []  # too short for an index: nothing, not a scan


def plan(queryset) -> str:
    sql, params = queryset.order_by().query.sql_with_params()
    with connection.cursor() as cursor:
        # Reading every row, by the table or by its primary key, is what a search must not do.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_indexscan = off")
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.parametrize("filterset, model, value, index", [
    (SessionFilter, Session, "release", "chorus_search_session_title"),
    (SessionFilter, Session, "release", "chorus_search_session_cwd"),
    (IssueFilter, Issue, "checkout", "chorus_search_issue_title"),
    (IssueFilter, Issue, "checkout", "chorus_search_issue_body"),
    (RunFilter, Run, "quota", "chorus_search_run_failure_message"),
])
def test_every_substring_search_is_served_by_its_trigram_index(filterset, model, value, index):
    factories.make_session()
    queryset = filterset({"q": value}, queryset=model.objects.all()).qs
    assert index in plan(queryset)
