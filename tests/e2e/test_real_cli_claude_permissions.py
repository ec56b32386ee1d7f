"""Real Claude Code set up differently from test_real_cli_claude.py (issue 10): in its default
permission mode a refused tool becomes a ``requires_action`` confirmation and "yes" resumes the
same Claude session with that tool allowed for the run; with the configured binary missing a turn
is a spawn failure naming it."""

from __future__ import annotations

import json

import pytest

from sessions_app.models import Session, Turn
from tests.e2e.real_cli import message, real_cli, standin, start, wait_status  # noqa: F401 — fixtures
from tests.model_standin import Reply, Tool

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def claude_default(real_cli):  # noqa: F811
    return real_cli("claude_code", claude_args="")


def test_a_permission_denial_is_a_confirmation_and_yes_resumes_with_the_tool_allowed(claude_default):
    bridge, model, ws = claude_default, claude_default["standin"], claude_default["workspace"]
    model.script(Reply(tools=[Tool.bash("echo hi > denied.txt")]), Reply(text="I need your permission."))
    turn = wait_status(start(bridge, "Write denied.txt"), "requires_action", bridge=bridge)
    assert not (ws / "denied.txt").exists()
    items = turn.requires_action["items"]
    assert turn.requires_action["kind"] == "confirmation" and len(items) == 1
    assert items[0]["text"].startswith("allow Bash:") and "denied.txt" in items[0]["text"]
    assert items[0]["allow"] == "Bash"
    session = Session.objects.get(pk=turn.session_id)
    assert session.backend_session_id

    # "yes": the same Claude session resumes with Bash allowed for that run, and the command now runs.
    model.script(Reply(tools=[Tool.bash("echo hi > denied.txt")]), Reply(text="Done, with your permission."))
    status, body = bridge["api"].call("POST", f"/turns/{turn.pk}/actions",
                                      {"answers": [{"id": items[0]["id"], "answer": "yes"}]})
    assert status == 200 and body["all_answered"], body
    resumed = wait_status(Turn.objects.get(pk=body["turn"]), "ended", bridge=bridge)
    payload = resumed.commands.get().payload
    assert payload["backend_session_id"] == session.backend_session_id and payload["allow_tools"] == ["Bash"]
    assert (ws / "denied.txt").read_text() == "hi\n" and "denied.txt" in json.dumps(resumed.changes)
    assert resumed.final_reply == "Done, with your permission." and resumed.requires_action is None
    asked = json.dumps(model.agent_requests()[-2].body["messages"])
    assert "Write denied.txt" in asked and "yes" in asked

    # The next run is back to the machine's permission mode: refused again, asked again; "no" widens nothing.
    model.script(Reply(tools=[Tool.bash("echo again > denied.txt")]), Reply(text="Asking again."))
    again = wait_status(message(bridge, session.pk, "Once more."), "requires_action", bridge=bridge)
    assert "allow_tools" not in again.commands.get().payload
    model.script(Reply(text="Understood, I will not."))
    status, body = bridge["api"].call("POST", f"/turns/{again.pk}/actions", {"answers": [
        {"id": again.requires_action["items"][0]["id"], "answer": "no"}]})
    refused = wait_status(Turn.objects.get(pk=body["turn"]), "ended", bridge=bridge)
    assert "allow_tools" not in refused.commands.get().payload
    assert (ws / "denied.txt").read_text() == "hi\n"


@pytest.fixture
def claude_missing(real_cli, tmp_path):  # noqa: F811
    return real_cli("claude_code", binary=str(tmp_path / "not-installed" / "claude"))


def test_a_missing_binary_is_a_spawn_failure_naming_it(claude_missing):
    turn = wait_status(start(claude_missing, "hello"), "interrupted", bridge=claude_missing)
    assert turn.interrupted_reason == "crash" and turn.wake_error["kind"] == "spawn_failed", turn.wake_error
    assert "not-installed/claude" in turn.wake_error["summary"] + turn.wake_error["details"]
    assert claude_missing["standin"].requests == []
