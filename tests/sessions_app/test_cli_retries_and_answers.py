"""Portal side of what the real CLIs do (issue 10), on reports shaped like theirs: a CLI retrying a
model call is a live "retrying" state of the turn; a "yes" to a permission denial widens the
resumed run; a partial reply before a crash stays in the transcript. The end-to-end proofs with the
real binaries are tests/e2e/test_real_cli_*.py."""

from __future__ import annotations

import uuid

import pytest

from chorus_site.models import Event
from sessions_app import bridge
from sessions_app.models import ControlCommand, Turn
from tests.sessions_app.test_bridge_and_actions import api, connection, online, post, report, start  # noqa: F401

pytestmark = pytest.mark.django_db

RETRY_1 = {"message": "retrying: authentication failed (attempt 1 of 10, next in 1 s)",
           "retry": {"attempt": 1, "max_retries": 10, "retry_delay_ms": 540, "error_status": 401,
                     "error": "authentication_failed"}}


def running_turn(operator, connection):  # noqa: F811
    answer = start(operator, connection)
    turn = Turn.objects.get(pk=answer["turn"])
    assert report(api(operator), connection, turn, status="running", pid=4242).status_code == 200
    return turn


def events(connection, turn, *items):  # noqa: F811
    bridge.report_events(connection=connection, turn_id=turn.pk, report={
        "report_id": str(uuid.uuid4()), "events": [{"kind": kind, "data": data} for kind, data in items]})


def retrying(client, turn):
    response = client.get(f"/api/v1/turns/{turn.pk}")
    assert response.status_code == 200
    return response.json()["retrying"]


def retrying_events(turn):
    return [e.data["retrying"] for e in Event.objects.filter(stream=turn.stream, kind="turn.retrying").order_by("id")]


def test_retry_lines_are_a_live_state_cleared_by_other_output_and_by_the_end(operator, connection):  # noqa: F811
    turn = running_turn(operator, connection)
    client = api(operator)
    events(connection, turn, ("progress", {"message": "session started"}))
    assert retrying(client, turn) is None and retrying_events(turn) == []

    events(connection, turn, ("progress", RETRY_1))
    now = retrying(client, turn)
    assert now["message"] == RETRY_1["message"] and (now["attempt"], now["max_retries"]) == (1, 10)
    assert now["error_status"] == 401 and now["next_attempt_at"] > now["since"]
    listed = client.get(f"/api/v1/sessions/{turn.session_id}/turns").json()["items"]
    assert listed[0]["retrying"]["message"] == RETRY_1["message"]

    second = {**RETRY_1, "message": "retrying: authentication failed (attempt 2 of 10, next in 2 s)"}
    events(connection, turn, ("progress", second))
    assert retrying(client, turn)["message"] == second["message"]
    events(connection, turn, ("text", {"text": "The model answered."}))
    assert retrying(client, turn) is None
    events(connection, turn, ("tool", {"name": "Bash", "input": {}}))  # not retrying before: no event
    assert retrying_events(turn) == [RETRY_1["message"], second["message"], ""]

    events(connection, turn, ("progress", RETRY_1))
    assert report(client, connection, turn, status="interrupted", reason="crash",
                  wake_error={"kind": "auth", "summary": "refused"}).status_code == 200
    assert retrying(client, turn) is None  # not running any more


def test_a_yes_to_a_permission_denial_allows_the_tool_for_the_resumed_run_only(operator, connection):  # noqa: F811
    client = api(operator)
    turn = running_turn(operator, connection)
    denial = {"kind": "confirmation", "items": [{"id": "toolu_1", "text": "allow Bash: echo hi > f", "allow": "Bash"},
                                                {"id": "toolu_2", "text": "allow Write: f", "allow": "Write"}]}
    assert report(client, connection, turn, status="requires_action", requires_action=denial).status_code == 200
    assert Turn.objects.get(pk=turn.pk).requires_action["items"][0]["allow"] == "Bash"
    response = post(client, f"/api/v1/turns/{turn.pk}/actions", {"answers": [
        {"id": "toolu_1", "answer": "Yes, go ahead"}, {"id": "toolu_2", "answer": "no"}]})
    assert response.status_code == 200, response.content
    resumed = Turn.objects.get(pk=response.json()["turn"])
    command = ControlCommand.objects.get(turn=resumed, action="resume")
    assert command.payload["allow_tools"] == ["Bash"]  # the "no" allows nothing

    assert report(client, connection, resumed, status="running", pid=4243).status_code == 200
    assert report(client, connection, resumed, status="ended", final_reply="done").status_code == 200
    later = post(client, f"/api/v1/sessions/{turn.session_id}/messages", {"prompt": "again"}).json()
    assert "allow_tools" not in ControlCommand.objects.get(turn_id=later["turn"], action="start_turn").payload


def test_a_partial_reply_before_a_crash_stays_in_the_transcript(operator, connection):  # noqa: F811
    client = api(operator)
    turn = running_turn(operator, connection)
    events(connection, turn, ("text", {"text": "Let me look first."}), ("text", {"text": "noise", "raw": True}),
           ("tool", {"name": "Bash", "input": {}}), ("text", {"text": "Found it: the key is sk-proj-"
                                                               "PARTIALcanary0123456789abcdefXYZ"}))
    assert report(client, connection, turn, status="interrupted", reason="crash",
                  wake_error={"kind": "signal", "summary": "killed"}).status_code == 200
    messages = client.get(f"/api/v1/sessions/{turn.session_id}/transcript").json()["items"]
    last = messages[-1]
    assert last["role"] == "assistant" and last["turn_id"] == str(turn.pk)
    assert last["text"].startswith("Let me look first.\n\nFound it: the key is ")
    assert last["text"].endswith("[partial reply: the turn was interrupted (crash) before it finished]")
    assert "noise" not in last["text"] and "PARTIALcanary" not in last["text"]  # raw lines out, secrets masked
