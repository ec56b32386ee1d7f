"""Every text that enters from the daemon is storable and redacted before it is stored (issue 8 items 2, 7).

One ingestion function per entry point (sessions_app/bridge.py ``_apply_advance`` / ``_apply_events``,
executions/agent_api.py ``_agent_text``); the whole database is searched for the secrets afterwards.
"""

from __future__ import annotations

import json
import uuid

import pytest
from django.test import Client
from django.utils import timezone

from executions.models import Artifact, Attempt, Comment
from executions.task_tokens import task_token_for
from sessions_app.models import Connection, Turn
from tests import factories
from tests.secret_search import database_texts, places_found

pytestmark = pytest.mark.django_db(transaction=True)

SECRETS = {
    "requires-action": "ghp_RequiresActionCanary0123456789abcdefAB",
    "cmdline": "sk-ant-api03-CmdlineCanary0123456789abcdefghijklmnopqrstuv",
    "wake-error": "xoxb-123456789012-1234567890123-WakeErrorCanary0123456789",
    "final-reply": "AKIAFINALREPLYQWZ234",
    "changes": "glpat-ChangesCanary0123456789ab",
    "outcome": "sk_live_OutcomeCanary0123456789abcdefABCD",
    "comment": "SG.CommentCanary0123456789.CommentCanary0123456789abcdefghijklmnopq",
    "artifact": "hf_ArtifactCanary0123456789abcdefghijkl",
    "artifact-name": "ghp_ArtifactNameCanary0123456789abcdefgh",
    "member": "sk-proj-MemberPromptCanary0123456789abcdefgh",
}


def daemon(connection) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {connection.plain_key}"}


def post_report(connection, turn, kind, body):
    body.setdefault("report_id", str(uuid.uuid4()))
    return Client().post(f"/api/v1/daemon/turns/{turn.pk}/{kind}", data=json.dumps(body),
                         content_type="application/json", **daemon(connection))


@pytest.fixture
def connection():
    connection = factories.make_connection(cwds=["/srv/work"])
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    return connection


def running_turn(operator, connection) -> Turn:
    client = Client()
    client.force_login(operator)
    response = client.post("/api/v1/sessions", data=json.dumps(
        {"connection": str(connection.pk), "cwd": "/srv/work/app", "prompt": "@reply hi"}),
        content_type="application/json")
    assert response.status_code == 201, response.content
    turn = Turn.objects.get(pk=response.json()["turn"])
    assert post_report(connection, turn, "advance", {"status": "running", "pid": 4242}).status_code == 200
    return turn


def test_advance_reports_are_redacted_in_every_field_before_storage(operator, connection):
    waiting = running_turn(operator, connection)
    response = post_report(connection, waiting, "advance", {
        "status": "requires_action",
        "requires_action": {"kind": "confirmation", "items": [
            {"id": "req-1", "text": f"Deploy with GITHUB_TOKEN={SECRETS['requires-action']}?"}]}})
    assert response.status_code == 200, response.content
    ended = running_turn(operator, connection)
    response = post_report(connection, ended, "advance", {
        "status": "ended", "final_reply": f"Used key {SECRETS['final-reply']} for S3.",
        "changes": {"git": True, "status": [f"M .env  # token {SECRETS['changes']}"], "diff_stat": "1 file"},
        "background_processes": [{"pid": 77, "cmdline": f"python serve.py --api-key {SECRETS['cmdline']}"}],
        "outcome": {"intent": "succeeded", "summary": f"deployed with {SECRETS['outcome']}"}})
    assert response.status_code == 200, response.content
    failed = running_turn(operator, connection)
    response = post_report(connection, failed, "advance", {
        "status": "interrupted", "reason": "crash",
        "wake_error": {"kind": "exited_nonzero", "summary": f"slack: invalid_auth {SECRETS['wake-error']}",
                       "source": "scripted", "details": f"Traceback\\n  token={SECRETS['wake-error']}", "exit_code": 1}})
    assert response.status_code == 200, response.content
    assert Turn.objects.get(pk=ended.pk).background_processes[0]["cmdline"].startswith("python serve.py --api-key ")
    assert places_found(SECRETS, database_texts()) == {}


def test_nul_in_agent_output_is_stored_replaced_and_never_a_server_error(operator, connection):
    turn = running_turn(operator, connection)
    raw = ('{"report_id": "%s", "events": [{"kind": "text", "data": {"text": "bad \\u0000 byte"}},'
           ' {"kind": "progress", "data": {"message": "ok\\u0000", "k\\u0000": "v"}}]}' % uuid.uuid4())
    response = Client().post(f"/api/v1/daemon/turns/{turn.pk}/events", data=raw, content_type="application/json",
                             **daemon(connection))
    assert response.status_code == 200, response.content
    assert response.json()["accepted"] == 2
    texts = [e.data["data"] for e in factories.events_of(turn.stream, kind="turn.output")]
    assert texts[0]["text"] == "bad \ufffd byte"
    assert texts[1] == {"message": "ok\ufffd", "k\ufffd": "v"}
    # A lone surrogate is refused by the report's schema (422, never a 500); our daemon replaces it
    # before it sends (tests/agents_daemon/test_redaction_before_spool.py).
    raw = '{"report_id": "%s", "events": [{"kind": "text", "data": {"text": "half \\ud800"}}]}' % uuid.uuid4()
    response = Client().post(f"/api/v1/daemon/turns/{turn.pk}/events", data=raw, content_type="application/json",
                             **daemon(connection))
    assert response.status_code in (200, 422), response.content
    response = post_report(connection, turn, "advance", {"status": "ended", "final_reply": "done\u0000 now"})
    assert response.status_code == 200, response.content
    assert Turn.objects.get(pk=turn.pk).final_reply == "done\ufffd now"


def test_a_private_key_printed_line_by_line_is_masked_in_one_report(operator, connection):
    turn = running_turn(operator, connection)
    body = ["MIIEowIBAAKCAQEAw9wR1dCh0a4xqv2mQjk0d0d6b0B1n4bx9y0e5oL4mXkRj7Qa",
            "Kz3b8vPq9rT2yW5uN1cF7gH4jL6mS0dA3eR8tY2uI5oP1aZ4xC7vB9nM3kJ6hG0f"]
    lines = ["-----BEGIN RSA PRIVATE KEY-----", *body, "-----END RSA PRIVATE KEY-----", "key written"]
    response = post_report(connection, turn, "events", {"events": [
        {"kind": "text", "data": {"text": line, "raw": True}} for line in lines]})
    assert response.status_code == 200, response.content
    stored = json.dumps([e.data for e in factories.events_of(turn.stream, kind="turn.output")])
    assert not any(line[:20] in stored for line in body)
    assert "key written" in stored


def test_what_agents_post_is_redacted_before_storage():
    run, _node, _task, attempt = factories.make_run_graph()
    Attempt.objects.filter(pk=attempt.pk).update(state="running")
    token = task_token_for(attempt)

    def agent_post(url, body):
        return Client().post(url, data=json.dumps(body), content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()))

    assert agent_post(f"/api/v1/issues/{run.issue_id}/comments",
                      {"body": f"progress; SENDGRID_API_KEY={SECRETS['comment']} works\x00"}).status_code == 201
    assert agent_post("/api/v1/artifacts", {"kind": "report", "name": f"{SECRETS['artifact-name']}.md",
                                            "content": f"# Report\nHF_TOKEN={SECRETS['artifact']}\n"}).status_code == 201
    assert agent_post(f"/api/v1/attempts/{attempt.pk}/outcome",
                      {"intent": "succeeded", "summary": f"done; key {SECRETS['outcome']}"}).status_code == 200
    agent_post(f"/api/v1/runs/{run.pk}/nodes", {"nodes": [{"key": "docs", "prompt": f"use {SECRETS['member']}"}]})
    assert Comment.objects.get(issue_id=run.issue_id).body.startswith("progress; SENDGRID_API_KEY=")
    assert Artifact.objects.get(issue_id=run.issue_id).content.startswith("# Report\nHF_TOKEN=")
    assert Attempt.objects.get(pk=attempt.pk).outcome["intent"] == "succeeded"
    assert places_found(SECRETS, database_texts()) == {}
