"""Issue 7 item 9 end to end: two real daemons (connections A and B), a session that moves from A to
B while its turn still runs on A.  Interrupting that turn must stop the agent on A; B never reports
it, and the stop is never ``confirmed`` while A's agent lives."""

from __future__ import annotations

import pytest

from sessions_app import services
from sessions_app.models import ControlCommand, Session, Turn
from tests.e2e.conftest import BRIDGE_SIGINT_TIMEOUT_S, Daemon, alive, wait_online, wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def second_host(bridge, tmp_path):
    workspace = tmp_path / "workspace-b"
    workspace.mkdir()
    home = tmp_path / "host-b"
    home.mkdir()
    connection, key = services.connection_register(name="e2e-daemon-b", backend="scripted", cwds=[str(workspace)],
                                                   sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S)
    daemon = Daemon(bridge["portal"], key, str(workspace), home, sigint_timeout_s=BRIDGE_SIGINT_TIMEOUT_S).start()
    wait_online(connection)
    yield {"connection": connection, "daemon": daemon, "workspace": workspace}
    daemon.stop()


def test_interrupt_after_a_move_stops_the_agent_on_the_host_that_runs_it(bridge, second_host):
    api = bridge["api"]
    a, b = bridge["connection"], second_host["connection"]
    status, first = api.call("POST", "/sessions", {"connection": str(a.pk), "cwd": str(bridge["workspace"]),
                                                  "prompt": "@sleep 120", "idea_key": "idea:moving"})
    assert status == 201, first
    turn = wait_until(lambda: (t := Turn.objects.get(pk=first["turn"])).status == "running" and t.pid and t,
                      timeout=30, message="the turn to run on A")
    agent_pid = turn.pid

    status, moved = api.call("POST", "/sessions", {"connection": str(b.pk), "cwd": str(second_host["workspace"]),
                                                  "prompt": "@reply on B", "idea_key": "idea:moving"})
    assert status == 201, moved
    assert moved["session"] == first["session"] and moved["queued"] is True
    assert Session.objects.get(pk=first["session"]).connection_id == b.pk

    status, answer = api.call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "moved"})
    assert status == 200 and answer["dispatched"] is True, answer
    assert ControlCommand.objects.get(turn=turn, action="interrupt").connection_id == a.pk

    def settled():
        t = Turn.objects.get(pk=turn.pk)
        if t.stop_state == "confirmed":
            # Never confirmed while the agent lives: checked at the moment it is first seen confirmed.
            assert not alive(agent_pid), "the stop is confirmed while the agent on A still runs"
            return t
        return None

    turn = wait_until(settled, timeout=BRIDGE_SIGINT_TIMEOUT_S + 20, message="a confirmed stop of A's agent")
    assert (turn.status, turn.interrupted_reason) == ("interrupted", "user")
    assert not ControlCommand.objects.filter(turn=turn, connection=b).exists()  # B is never asked about it
    # The move queued behind the running turn: the next turn now runs on B, in B's directory.
    # It starts a fresh agent session there: A's agent session does not exist on B.
    queued = wait_until(lambda: (t := Turn.objects.get(pk=moved["turn"])).status in {"ended", "interrupted"} and t,
                        timeout=30, message="the queued turn to run on B")
    assert queued.status == "ended", queued.wake_error
    assert queued.connection_id == b.pk and queued.final_reply == "on B"
