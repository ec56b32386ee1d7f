"""Real Claude Code set up differently from test_real_cli_claude.py (issue 10): in its default
permission mode a refused tool becomes a ``requires_action`` confirmation and the answer resumes
the same Claude session; with the configured binary missing a turn is a spawn failure naming it."""

from __future__ import annotations

import json

import pytest

from sessions_app.models import Session, Turn
from tests.e2e.real_cli import real_bridge, standin, start, stop_bridge, wait_status  # noqa: F401
from tests.model_standin import Reply, Tool

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def claude_default(portal_server, celery_beat_worker, operator, workspace, tmp_path, standin):  # noqa: F811
    bridge = real_bridge("claude_code", portal_server, operator, workspace, tmp_path, standin, claude_args="")
    yield bridge
    stop_bridge(bridge)


def test_a_permission_denial_is_a_confirmation_and_the_answer_resumes_the_session(claude_default):
    bridge, model, ws = claude_default, claude_default["standin"], claude_default["workspace"]
    model.script(Reply(tools=[Tool.bash("echo hi > denied.txt")]), Reply(text="I need your permission."))
    turn = wait_status(start(bridge, "Write denied.txt"), "requires_action", bridge=bridge)
    assert not (ws / "denied.txt").exists()
    items = turn.requires_action["items"]
    assert turn.requires_action["kind"] == "confirmation" and len(items) == 1
    assert items[0]["text"].startswith("allow Bash:") and "denied.txt" in items[0]["text"]
    session = Session.objects.get(pk=turn.session_id)
    assert session.backend_session_id

    model.script(Reply(text="Thanks, noted."))
    status, body = bridge["api"].call("POST", f"/turns/{turn.pk}/actions",
                                      {"answers": [{"id": items[0]["id"], "answer": "yes"}]})
    assert status == 200 and body["all_answered"], body
    resumed = wait_status(Turn.objects.get(pk=body["turn"]), "ended", bridge=bridge)
    assert resumed.commands.get().payload["backend_session_id"] == session.backend_session_id
    last = json.dumps(model.agent_requests()[-1].body["messages"])
    assert "Write denied.txt" in last and "yes" in last


@pytest.fixture
def claude_missing(portal_server, celery_beat_worker, operator, workspace, tmp_path, standin):  # noqa: F811
    bridge = real_bridge("claude_code", portal_server, operator, workspace, tmp_path, standin,
                         binary=str(tmp_path / "not-installed" / "claude"))
    yield bridge
    stop_bridge(bridge)


def test_a_missing_binary_is_a_spawn_failure_naming_it(claude_missing):
    turn = wait_status(start(claude_missing, "hello"), "interrupted", bridge=claude_missing)
    assert turn.interrupted_reason == "crash" and turn.wake_error["kind"] == "spawn_failed", turn.wake_error
    assert "not-installed/claude" in turn.wake_error["summary"] + turn.wake_error["details"]
    assert claude_missing["standin"].requests == []
