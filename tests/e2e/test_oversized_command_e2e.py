"""An oversized command never blocks a connection (issue 7 item 14), with the real daemon.

Before: a command larger than the daemon's frame limit closed the daemon's socket, the daemon
reconnected, the command was replayed first again, and the connection's other sessions never got
their commands (for up to the command's one-hour TTL).
"""

from __future__ import annotations

import pytest

from agents import protocol
from sessions_app import actions
from sessions_app.models import ControlCommand, Turn
from tests import factories
from tests.e2e.conftest import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_after_an_oversized_command_the_connection_keeps_serving_other_sessions(bridge):
    workspace = bridge["workspace"]
    (workspace / "big").mkdir()
    (workspace / "small").mkdir()
    big_session = factories.make_session(connection=bridge["connection"], cwd=str(workspace / "big"))
    # Made past the API's prompt bound (as merged or older prompts could be): 4.4 MB of UTF-8 (13 MB
    # as escaped JSON), beyond the daemon's 4 MiB frame limit however it is encoded.
    huge = "é" * 2_200_000
    assert len(huge.encode()) > protocol.COMMAND_MAX_BYTES
    big = actions.turn_enqueue(session_id=big_session.pk, trigger="human_instruction", prompt=huge)["turn"]
    status, body = bridge["api"].call("POST", "/sessions", {
        "connection": str(bridge["connection"].pk), "cwd": str(workspace / "small"), "prompt": "@reply still served"})
    assert status == 201, body
    small = Turn.objects.get(pk=body["turn"])

    ended = wait_until(lambda: (t := Turn.objects.get(pk=small.pk)).status == "ended" and t, timeout=45,
                       message="the other session's turn to run to its end")
    assert ended.final_reply == "still served"
    big_turn = wait_until(lambda: (t := Turn.objects.get(pk=big)).status == "interrupted" and t, timeout=15,
                          message="the oversized turn to settle")
    assert big_turn.wake_error["kind"] == "protocol" and "not sent" in big_turn.wake_error["summary"]
    assert ControlCommand.objects.get(turn_id=big).state == "expired"
    # The daemon's link stayed up: it never had to reconnect over the oversized command.
    log = bridge["daemon"].log()
    assert log.count("connected to ws://") == 1 and "portal connection:" not in log, log[-2000:]
