"""The troubleshooting record (SPEC §9): content, retry levels, cursors, redaction, API and admin access."""

from __future__ import annotations

import hashlib
import json

import pytest
from django.test import Client
from django.urls import reverse

from chorus_site.events import event_append
from chorus_site.models import AuditEntry, EventStream
from executions.models import Artifact, Attempt, Comment
from executions.troubleshooting import record_markdown, run_record
from sessions_app import services
from sessions_app.models import Turn
from sessions_app.troubleshooting import session_markdown, session_record
from tests import factories

pytestmark = pytest.mark.django_db

CANARY = "sk-ant-api03-TROUBLEcanary0123456789abcdef"


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _turn(session, attempt, *, prompt, status, reason=None, wake_error=None, final_reply=None):
    """A real turn of the session driven through the services, then linked to the attempt."""
    turn = services.turn_create(session=session, trigger="task_assigned", prompt=prompt)
    services.turn_set_status(turn_id=turn.pk, status="running")
    extra = {"final_reply": final_reply} if final_reply is not None else {}
    services.turn_set_status(turn_id=turn.pk, status=status, reason=reason, wake_error=wake_error, **extra)
    Turn.objects.filter(pk=turn.pk).update(attempt_id=attempt.pk)
    Attempt.objects.filter(pk=attempt.pk).update(turn=turn)
    return Turn.objects.get(pk=turn.pk)


def _artifact(issue, run, attempt, *, name, kind, content):
    return Artifact.objects.create(issue=issue, run=run, attempt=attempt, kind=kind, name=name, content=content,
                                   sha256=hashlib.sha256(content.encode()).hexdigest(), size=len(content))


@pytest.fixture
def graph():
    """task 1: attempt 1 (spawn failure: infrastructure) → attempt 2 (agent crash); task 2 (policy retry) succeeds."""
    connection = factories.make_connection(host="build-host-7")
    issue = factories.make_issue(acceptance_criteria="The tests pass and the README says how.", status="in_review")
    run, node, task1, attempt1 = factories.make_run_graph(issue=issue, run_state="succeeded", node_state="succeeded",
                                                          task_status="failed", attempt_state="failed",
                                                          connection=connection)
    node.config = {"retry": {"max_task_retries": 1}}
    node.save(update_fields=["config"])
    session1 = factories.make_session(connection=connection, idea_key=f"task:{task1.pk}",
                                      backend_session_id="backend-sess-one", provider="anthropic",
                                      model="claude-sonnet-4")
    Attempt.objects.filter(pk=attempt1.pk).update(session=session1, failure_code="infrastructure",
                                                  failure_message="the turn ended interrupted (crash): spawn_failed")
    turn1 = _turn(session1, attempt1, prompt="do the thing", status="interrupted", reason="crash",
                  wake_error={"kind": "spawn_failed", "exit_code": 127, "summary": f"spawn failed {CANARY}",
                              "details": f"env dump\nANTHROPIC_API_KEY={CANARY}\nno such file"})
    attempt2 = factories.make_attempt(task=task1, state="failed", connection=connection, session=session1,
                                      provider_session_id="backend-sess-one", failure_code="agent_crashed",
                                      failure_message="agent exited with code 3")
    turn2 = _turn(session1, attempt2, prompt="do the thing again", status="interrupted", reason="crash",
                  wake_error={"kind": "exited_nonzero", "exit_code": 3, "summary": "agent exited with code 3",
                              "details": f"Traceback\nAuthorization: Bearer {CANARY}\nboom"})
    task2 = factories.make_task(node=node, status="completed", retry_of=task1)
    session2 = factories.make_session(connection=connection, idea_key=f"task:{task2.pk}",
                                      backend_session_id="backend-sess-two", provider="anthropic",
                                      model="claude-opus-4")
    attempt3 = factories.make_attempt(task=task2, state="succeeded", connection=connection, session=session2,
                                      outcome={"intent": "succeeded", "summary": "all green"})
    long_prompt = "Fix the build. " + "Context line. " * 40 + f"token {CANARY}"
    turn3 = _turn(session2, attempt3, prompt=long_prompt, status="ended",
                  final_reply="Done. " + "Details. " * 40 + f"used {CANARY}")
    diff = _artifact(issue, run, attempt3, name="fix.diff", kind="diff", content="--- a\n+++ b\n")
    log = _artifact(issue, run, attempt3, name="pytest.log", kind="test_log", content="3 passed\n")
    event_append(stream=run.stream, kind="run.state", data={"id": str(run.pk), "state": "succeeded"})
    return {"run": run, "issue": issue, "connection": connection, "tasks": [task1, task2],
            "attempts": [attempt1, attempt2, attempt3], "sessions": [session1, session2],
            "turns": [turn1, turn2, turn3], "artifacts": [diff, log]}


def _cursor(stream: str) -> int:
    return EventStream.objects.get(name=stream).last_event_id


def _all_attempts(record):
    return [a for n in record["nodes"] for t in n["tasks"] for a in t["attempts"]]


# ---------------------------------------------------------------- content
def test_record_lists_every_attempt_with_session_connection_and_retry_level(graph):
    record = run_record(graph["run"])
    issue, run = record["issue"], record["run"]
    assert issue["id"] == str(graph["issue"].pk)
    assert issue["acceptance_criteria"] == "The tests pass and the README says how."
    assert issue["acceptance"] == {"pending": True, "state": "awaiting_review", "issue_status": "in_review"}
    assert run["id"] == str(graph["run"].pk) and run["mode"] == "direct" and run["state"] == "succeeded"
    assert run["event_cursor"] == _cursor(graph["run"].stream) > 0

    tasks = record["nodes"][0]["tasks"]
    assert [(t["ordinal"], t["made_by"], t["retry_of"]) for t in tasks] == [
        (1, "first_task", None), (2, "policy_retry", str(graph["tasks"][0].pk))]
    attempts = _all_attempts(record)
    assert [a["id"] for a in attempts] == [str(a.pk) for a in graph["attempts"]]  # failed ones kept, in order
    assert [(a["number"], a["made_by"], a["state"]) for a in attempts] == [
        (1, "first_attempt", "failed"), (2, "infrastructure_retry", "failed"), (1, "first_attempt", "succeeded")]
    assert attempts[0]["failure_code"] == "infrastructure" and attempts[1]["failure_code"] == "agent_crashed"

    for attempt, session, turn in zip(attempts, [graph["sessions"][0]] * 2 + [graph["sessions"][1]], graph["turns"]):
        assert attempt["session_id"] == str(session.pk)
        assert attempt["backend_session_id"] == session.backend_session_id
        assert attempt["connection"]["id"] == str(graph["connection"].pk)
        assert attempt["connection"]["name"] == graph["connection"].name
        assert attempt["host"] == "build-host-7"
        assert (attempt["backend"], attempt["provider"], attempt["model"]) == (
            "scripted", "anthropic", session.model)
        assert attempt["turn_id"] == attempt["turn"]["id"] == str(turn.pk)
        assert attempt["session"]["event_cursor"] == _cursor(session.stream) > 0
        assert record["event_cursors"][session.stream] == _cursor(session.stream)
    assert record["event_cursors"][graph["run"].stream] == run["event_cursor"]

    first = attempts[0]["turn"]
    assert (first["status"], first["interrupted_reason"], first["stop_state"]) == ("interrupted", "crash", "none")
    assert first["wake_error"]["kind"] == "spawn_failed" and first["wake_error"]["exit_code"] == 127
    assert first["wake_error"]["details"] is None and first["wake_error"]["details_withheld"] is True
    assert attempts[2]["outcome"]["intent"] == "succeeded"
    assert record["summary"]["policy_retries"] == 1 and record["summary"]["infrastructure_retries"] == 1


def test_artifacts_and_test_logs_are_linked(graph):
    record = run_record(graph["run"])
    diff, log = graph["artifacts"]
    assert [a["id"] for a in record["artifacts"]] == [str(diff.pk), str(log.pk)]
    assert [a["id"] for a in record["test_logs"]] == [str(log.pk)]
    entry = record["test_logs"][0]
    assert entry["link"] == f"/api/v1/artifacts/{log.pk}/content"
    assert (entry["name"], entry["kind"], entry["sha256"], entry["size"]) == ("pytest.log", "test_log", log.sha256, 9)
    assert [a["id"] for a in _all_attempts(record)[2]["artifacts"]] == [str(diff.pk), str(log.pk)]


def test_redacted_record_keeps_short_previews(graph):
    turn = _all_attempts(run_record(graph["run"]))[2]["turn"]
    assert turn["prompt"]["truncated"] and len(turn["prompt"]["text"]) <= 201
    assert turn["prompt"]["chars"] == len(graph["turns"][2].prompt)
    full = _all_attempts(run_record(graph["run"], redacted=False))[2]["turn"]
    assert full["prompt"]["text"] == graph["turns"][2].prompt and not full["prompt"]["truncated"]


def test_markdown_report_has_headings_and_an_attempt_table(graph):
    text = record_markdown(run_record(graph["run"]))
    assert text.startswith(f"# Troubleshooting record — run {graph['run'].pk}")
    for heading in ("## Issue", "## Run", "## Attempts", "## Nodes", "## Artifacts", "## Test logs"):
        assert f"\n{heading}" in text
    assert "| node | task | attempt | state |" in text
    assert "attempt 2 (infrastructure retry)" in text and "task 2 (policy retry)" in text
    for attempt in graph["attempts"]:
        assert str(attempt.pk) in text
    assert "backend-sess-one" in text and "build-host-7" in text
    assert f"/api/v1/artifacts/{graph['artifacts'][1].pk}/content" in text
    assert f"`run:{graph['run'].pk}`: {_cursor(graph['run'].stream)}" in text


@pytest.mark.parametrize("redacted", [True, False])
@pytest.mark.parametrize("details", [True, False])
def test_canary_never_appears(graph, redacted, details):
    """Storage masked the agent's output; no export mode undoes that."""
    record = run_record(graph["run"], redacted=redacted, include_details=details)
    assert CANARY not in json.dumps(record)
    assert CANARY not in record_markdown(record)
    session = session_record(graph["sessions"][0], redacted=redacted, include_details=details)
    assert CANARY not in json.dumps(session) and CANARY not in session_markdown(session)
    if details:
        assert "[REDACTED]" in _all_attempts(record)[0]["turn"]["wake_error"]["details"]


def test_what_operators_typed_is_masked_in_the_redacted_record(graph):
    """Issue text and failure messages are not masked at storage: the shared export masks them."""
    issue, run = graph["issue"], graph["run"]
    type(issue).objects.filter(pk=issue.pk).update(acceptance_criteria=f"deploy with OPENAI_API_KEY={CANARY}")
    type(run).objects.filter(pk=run.pk).update(failure_message=f"failed: {CANARY}",
                                               wait_detail={"api_key": CANARY})
    Comment.objects.create(issue=issue, type="result", author="agent", body=f"key {CANARY}",
                           source_attempt=graph["attempts"][2])
    record = run_record(run)
    assert CANARY not in json.dumps(record) and CANARY not in record_markdown(record)
    assert "OPENAI_API_KEY=[REDACTED]" in record["issue"]["acceptance_criteria"]


def test_session_record_names_its_runs(graph):
    session = graph["sessions"][0]
    record = session_record(session)
    assert record["session"]["backend_session_id"] == "backend-sess-one"
    assert record["connection"]["host"] == "build-host-7"
    assert record["event_cursors"][session.stream] == _cursor(session.stream)
    assert [t["id"] for t in record["turns"]] == [str(graph["turns"][0].pk), str(graph["turns"][1].pk)]
    work = record["work"]["attempts"]
    assert [(w["attempt"], w["made_by"]) for w in work] == [(str(graph["attempts"][0].pk), "first_attempt"),
                                                           (str(graph["attempts"][1].pk), "infrastructure_retry")]
    assert {w["issue"] for w in work} == {str(graph["issue"].pk)} and work[0]["acceptance_pending"] is True
    assert "## Attempts" in session_markdown(record)


# ---------------------------------------------------------------- API
def test_api_outsider_404_viewer_json_and_markdown(graph, outsider, viewer):
    url = f"/api/v1/runs/{graph['run'].pk}/troubleshooting"
    assert client_for(outsider).get(url).status_code == 404
    answer = client_for(viewer).get(url)
    assert answer.status_code == 200 and answer["Content-Type"].startswith("application/json")
    body = answer.json()
    assert body["redacted"] is True and len(_all_attempts(body)) == 3
    md = client_for(viewer).get(url, {"format": "md"})
    assert md.status_code == 200 and md["Content-Type"].startswith("text/markdown")
    assert md["Content-Disposition"] == f'attachment; filename="run-{graph["run"].pk}.md"'
    assert CANARY not in answer.content.decode() and CANARY not in md.content.decode()
    assert client_for(viewer).get(url, {"format": "pdf"}).status_code == 400
    assert AuditEntry.objects.count() == 0


def test_api_unredacted_is_for_diagnostics_and_audited(graph, viewer, operator, diagnostics_reader):
    url = f"/api/v1/runs/{graph['run'].pk}/troubleshooting"
    for user in (viewer, operator):
        for params in ({"redacted": "0"}, {"details": "1"}):
            denied = client_for(user).get(url, params)
            assert denied.status_code == 403 and denied.json()["error"]["code"] == "forbidden"
    assert AuditEntry.objects.count() == 0
    answer = client_for(diagnostics_reader).get(url, {"redacted": "0"})
    assert answer.status_code == 200 and answer.json()["redacted"] is False
    assert CANARY not in answer.content.decode()
    entries = list(AuditEntry.objects.all())
    assert len(entries) == 1
    assert (entries[0].actor, entries[0].action, entries[0].target, entries[0].client) == (
        "diagnostics_reader", "troubleshooting.export", f"run:{graph['run'].pk}", "api")
    with_details = client_for(diagnostics_reader).get(url, {"details": "1", "format": "md"})
    assert with_details.status_code == 200 and "ANTHROPIC_API_KEY=[REDACTED]" in with_details.content.decode()
    assert AuditEntry.objects.count() == 2


def test_api_session_record(graph, outsider, viewer, diagnostics_reader):
    session = graph["sessions"][1]
    url = f"/api/v1/sessions/{session.pk}/troubleshooting"
    assert client_for(outsider).get(url).status_code == 404
    assert client_for(viewer).get(url).json()["session"]["id"] == str(session.pk)
    md = client_for(viewer).get(url, {"format": "md"})
    assert md["Content-Disposition"] == f'attachment; filename="session-{session.pk}.md"'
    assert client_for(viewer).get(url, {"redacted": "0"}).status_code == 403
    assert client_for(diagnostics_reader).get(url, {"redacted": "0"}).status_code == 200
    assert AuditEntry.objects.filter(target=f"session:{session.pk}").count() == 1
    assert CANARY not in md.content.decode()


def test_api_unknown_run_is_404(viewer):
    assert client_for(viewer).get("/api/v1/runs/00000000-0000-7000-8000-000000000000/troubleshooting"
                                  ).status_code == 404


# ---------------------------------------------------------------- admin
def test_admin_run_page_offers_the_downloads(graph, viewer, outsider):
    run = graph["run"]
    page = client_for(viewer).get(reverse("admin:executions_run_change", args=[run.pk]))
    md_url = reverse("admin:executions_run_troubleshooting_md", args=[run.pk])
    json_url = reverse("admin:executions_run_troubleshooting_json", args=[run.pk])
    assert md_url.endswith(f"/{run.pk}/troubleshooting.md")
    assert md_url in page.content.decode() and json_url in page.content.decode()
    md = client_for(viewer).get(md_url)
    assert md.status_code == 200 and md["Content-Disposition"] == f'attachment; filename="run-{run.pk}.md"'
    assert f"# Troubleshooting record — run {run.pk}" in md.content.decode()
    as_json = client_for(viewer).get(json_url)
    assert as_json.status_code == 200 and as_json.json()["redacted"] is True
    assert CANARY not in md.content.decode() + as_json.content.decode()
    assert client_for(outsider).get(md_url).status_code == 403
    missing = reverse("admin:executions_run_troubleshooting_md", args=["00000000-0000-7000-8000-000000000000"])
    assert client_for(viewer).get(missing).status_code == 404
