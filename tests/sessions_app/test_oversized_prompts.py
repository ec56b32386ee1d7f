"""Oversized prompts and commands (issue 7 item 14).

Reproduction: a 2.4 MB prompt of non-ASCII text became a 7.2 MB command (each "é" escaped to 6 bytes),
the daemon could not take the frame, reconnected, and the command replayed for an hour, blocking the
connection's other sessions.
"""

from __future__ import annotations

import pytest
from django.test import Client

from agents import protocol
from sessions_app import actions, bridge
from sessions_app.models import ControlCommand, Session, Turn
from tests import factories

from .test_bridge_and_actions import api, online, post, report, start

pytestmark = pytest.mark.django_db

BIG = "é" * 140_000  # 280 000 bytes of UTF-8: over the default 256 KiB


@pytest.fixture
def connection():
    return online(factories.make_connection(cwds=["/srv/work"]))


def assert_413(response, field):
    assert response.status_code == 413, response.content
    error = response.json()["error"]
    assert error["code"] == "payload_too_large" and error["detail"]["field"] == field
    assert error["detail"]["bytes"] == len(BIG.encode()) and error["detail"]["limit"] == 256 * 1024


def test_prompts_and_contexts_beyond_the_bound_are_413_and_create_nothing(operator, connection):
    client = api(operator)
    before = Turn.objects.count(), ControlCommand.objects.count(), Session.objects.count()
    assert_413(post(client, "/api/v1/sessions", {"connection": str(connection.pk), "cwd": "/srv/work/app",
                                                 "prompt": BIG}), "prompt")
    assert (Turn.objects.count(), ControlCommand.objects.count(), Session.objects.count()) == before

    turn = Turn.objects.get(pk=start(operator, connection)["turn"])
    report(Client(), connection, turn, status="running")
    report(Client(), connection, turn, status="interrupted", reason="crash",
           wake_error={"kind": "exited_nonzero", "exit_code": 1})
    before = Turn.objects.count(), ControlCommand.objects.count()
    assert_413(post(client, f"/api/v1/sessions/{turn.session_id}/messages", {"prompt": BIG}), "prompt")
    assert_413(post(client, f"/api/v1/sessions/{turn.session_id}/resume", {"context": BIG}), "context")
    assert_413(post(client, f"/api/v1/sessions/{turn.session_id}/handoff", {"context": BIG}), "context")
    assert (Turn.objects.count(), ControlCommand.objects.count()) == before


def test_the_bound_is_a_setting(operator, connection, settings):
    settings.CHORUS_PROMPT_MAX_BYTES = 2048
    response = post(api(operator), "/api/v1/sessions", {"connection": str(connection.pk), "cwd": "/srv/work/app",
                                                        "prompt": "é" * 1025})
    assert response.status_code == 413 and response.json()["error"]["detail"]["limit"] == 2048
    assert start(operator, connection, prompt="é" * 1024)["turn"]


def test_frames_carry_non_ascii_unescaped():
    message = {"type": protocol.COMMAND, "payload": {"prompt": "é" * 1000}}
    assert "\\u00e9" not in protocol.encode(message)
    assert protocol.encoded_size(message) < 2100  # 2 bytes per "é", not 6
    assert protocol.decode(protocol.encode({"type": "x", "text": "é✓"}))["text"] == "é✓"


def test_a_command_too_large_to_send_is_expired_and_does_not_block_the_others(operator, connection):
    """A command that cannot be sent (here: made outside the API, beyond COMMAND_MAX_BYTES) expires with
    a reason, its turn settles with a clear wake error, and the connection's other commands go."""
    session = factories.make_session(connection=connection, cwd="/srv/work/big")
    huge = "é" * (protocol.COMMAND_MAX_BYTES // 2 + 10)
    big_turn = actions.turn_enqueue(session_id=session.pk, trigger="human_instruction", prompt=huge)["turn"]
    other = Turn.objects.get(pk=start(operator, connection)["turn"])
    delivered = bridge.commands_to_deliver(connection_id=connection.pk)
    assert [c["turn"] for c in delivered] == [str(other.pk)]
    command = ControlCommand.objects.get(turn_id=big_turn)
    assert command.state == "expired" and command.result["error"] == "frame_too_large"
    turn = Turn.objects.get(pk=big_turn)
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "crash")
    assert turn.wake_error["kind"] == "protocol" and "not sent" in turn.wake_error["summary"]
    assert api(operator).get(f"/api/v1/turns/{turn.pk}").status_code == 200
    # Next time only what is still unacked is replayed; the expired command never again.
    assert [c["turn"] for c in bridge.commands_to_deliver(connection_id=connection.pk)] == [str(other.pk)]
