"""Fault injection, issue 7 items 6, 8, 10: the daemon's snapshot is the truth about the processes it
holds (SPEC §11).  Real daphne, a real Celery worker with beat (the stale sweep), the real daemon
spawning the scripted agent, Redis of the test's own, PostgreSQL.

The heartbeat threshold is the shortest the settings allow (CHORUS_HEARTBEAT_TIMEOUT_S=10).  A daemon
frozen or killed: the outage lasts until the sweep has settled what it settles (the portal has guessed
"offline"), then the daemon comes back and its word must win.  The portal down: the sweep must guess
nothing at all, however long the outage (SPEC §11 R9).
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
from django.utils import timezone

from chorus_site.models import Event
from sessions_app.models import Connection, ControlCommand, Turn
from tests.e2e.conftest import Daemon, alive, kill_group, start_portal, stop_process, wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

HEARTBEAT_TIMEOUT_S = 10          # the settings' minimum
SWEPT_WITHIN_S = HEARTBEAT_TIMEOUT_S + 5 + 20   # threshold + one beat + a loaded machine's slack


@pytest.fixture
def short_heartbeat_timeout(monkeypatch):
    """Read by daphne and the Celery worker when fault_stack starts them (request it first)."""
    monkeypatch.setenv("CHORUS_HEARTBEAT_TIMEOUT_S", str(HEARTBEAT_TIMEOUT_S))


def start(stack, prompt: str, idea_key: str | None = None) -> Turn:
    body = {"connection": str(stack["connection"].pk), "cwd": str(stack["workspace"]), "prompt": prompt,
            "acknowledge_changes": True}
    if idea_key:
        body["idea_key"] = idea_key
    status, answer = stack["api"].call("POST", "/sessions", body)
    assert status == 201, answer
    return Turn.objects.get(pk=answer["turn"])


def wait_turn(turn, predicate, timeout, message):
    def check():
        current = Turn.objects.get(pk=turn.pk)
        return current if predicate(current) else None

    try:
        return wait_until(check, timeout=timeout, message=message)
    except AssertionError as error:
        current = Turn.objects.get(pk=turn.pk)
        raise AssertionError(f"{error}; the turn is {current.status_label}, stop {current.stop_state}, "
                             f"evidence {current.interrupt_evidence}") from None


def settled_offline(t: Turn) -> bool:
    return (t.status, t.interrupted_reason) == ("interrupted", "offline")


def reconciled(turn) -> list[Event]:
    return list(Event.objects.filter(stream=turn.stream, kind="turn.reconciled", data__id=str(turn.pk)))


def test_portal_down_three_thresholds_no_live_turn_is_settled_offline_and_every_end_lands(
        short_heartbeat_timeout, fault_stack, tmp_path):
    """SPEC §11 R9, issue 7 item 8: daphne down for 3 heartbeat thresholds while agents work; the
    Celery sweep keeps running but judges no daemon's silence the portal could not hear."""
    stack = fault_stack
    during = start(stack, "@sleep 6\n@reply ended while the portal was down", idea_key="idea:during")
    after = start(stack, "@sleep 45\n@reply done", idea_key="idea:after")
    for turn in (during, after):
        wait_turn(turn, lambda t: t.status == "running" and t.pid, 30, "the agents to run")
    during_pid = Turn.objects.get(pk=during.pk).pid
    portal = stack["portal"]
    port = int(portal.rsplit(":", 1)[1])
    stop_process(portal.process)               # daphne goes down; Celery (and its sweep) keep running
    connection = stack["connection"]
    # The outage is the fault injected: it lasts until the daemon's last frame is 3 thresholds old.
    wait_until(lambda: timezone.now() - Connection.objects.get(pk=connection.pk).last_heartbeat_at
               > timedelta(seconds=3 * HEARTBEAT_TIMEOUT_S), timeout=3 * HEARTBEAT_TIMEOUT_S + 15,
               message="an outage of 3 heartbeat thresholds")
    assert not alive(during_pid)               # one agent ended meanwhile: its end report waits in the spool
    restarted = start_portal(port, tmp_path, name="daphne-restarted")
    try:
        for turn, reply in ((during, "ended while the portal was down"), (after, "done")):
            ended = wait_turn(turn, lambda t: t.status == "ended", 60, "the agent's end report")
            assert ended.final_reply == reply
        assert stack["daemon"].process.poll() is None
        for turn in (during, after):
            # The event log, not only the final state: never settled offline, not even for a while.
            statuses = [e.data["status"] for e in Event.objects.filter(stream=turn.stream, kind="turn.status",
                                                                        data__id=str(turn.pk)).order_by("id")]
            assert statuses == ["running", "ended"], statuses
            assert not reconciled(turn)
        # every report landed: nothing is left in the daemon's spool
        wait_until(lambda: not list((tmp_path / "spool").glob("0*.json")), timeout=30, message="an empty spool")
        # The sweep did run all along: it judged nobody while the portal was down.
        assert "stale sweep: no daemon judged; the portal is down" in (tmp_path / "celery-beat.log").read_text()
    finally:
        stop_process(restarted)


def test_a_frozen_daemon_comes_back_holding_its_turn_and_interrupt_stops_the_agent(
        short_heartbeat_timeout, fault_stack):
    stack = fault_stack
    turn = start(stack, "@sleep 300\nLong work")
    running = wait_turn(turn, lambda t: t.status == "running" and t.pid, 30, "the agent to run")
    daemon_pid = stack["daemon"].process.pid
    os.kill(daemon_pid, signal.SIGSTOP)
    try:
        wait_turn(turn, settled_offline, SWEPT_WITHIN_S, "the sweep to settle the frozen daemon's turn offline")
        assert alive(running.pid)               # the portal's guess: the agent works on
    finally:
        os.kill(daemon_pid, signal.SIGCONT)
    # Within a heartbeat or so the portal agrees with the daemon: the turn runs, held by its daemon.
    back = wait_turn(turn, lambda t: t.status == "running", 3 * 5 + 10, "the daemon's word to reopen the turn")
    assert reconciled(turn)
    assert Connection.objects.get(pk=stack["connection"].pk).status == "online"
    status, answer = stack["api"].call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "fault test"})
    assert status == 200 and answer["changed"] is True and answer["dispatched"] is True, answer
    stopped = wait_turn(turn, lambda t: t.stop_state == "confirmed", 30, "a confirmed stop")
    assert (stopped.status, stopped.interrupted_reason) == ("interrupted", "user")
    assert not alive(back.pid)


def test_a_stop_its_frozen_daemon_confirms_after_the_deadline_lands_late(fault_stack, tmp_path):
    """Issue 7 ("never confirmed while a process lives", "no report dropped"): the daemon is frozen
    while an operator interrupts; the stop goes ``unconfirmed``.  Thawed, the daemon stops the agent:
    its steps (signalled, then interrupted/confirmed) land, not refused and parked behind a 409.
    The default heartbeat threshold (20 s) outlasts the stop's deadline (2 + 5 s): never settled offline."""
    stack = fault_stack
    turn = start(stack, "@sleep 300\nLong work")
    running = wait_turn(turn, lambda t: t.status == "running" and t.pid, 30, "the agent to run")
    daemon_pid = stack["daemon"].process.pid
    os.kill(daemon_pid, signal.SIGSTOP)
    try:
        status, answer = stack["api"].call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "fault test"})
        assert status == 200 and answer["dispatched"] is True, answer
        wait_turn(turn, lambda t: t.stop_state == "unconfirmed", 20, "the stop's deadline to pass unconfirmed")
        assert alive(running.pid)               # in doubt, rightly: the agent lives
    finally:
        os.kill(daemon_pid, signal.SIGCONT)
    stopped = wait_turn(turn, lambda t: t.stop_state == "confirmed", 20, "the daemon's late confirmation")
    assert (stopped.status, stopped.interrupted_reason) == ("interrupted", "user")
    assert not alive(running.pid)
    steps = [(e.data["step"], e.data["applied"]) for e in Event.objects.filter(
        stream=turn.stream, kind="turn.stop_late", data__id=str(turn.pk)).order_by("id")]
    assert steps and steps[-1] == ("confirmed", True) and all(not applied for _, applied in steps[:-1]), steps
    # No report of the daemon was refused (a refusal is retried slowly, then parked).
    wait_until(lambda: not list((tmp_path / "spool").glob("0*.json")), timeout=20, message="an empty spool")
    assert not list((tmp_path / "spool" / "parked").glob("*.json"))
    spool = Connection.objects.get(pk=stack["connection"].pk).capabilities.get("spool") or {}
    assert spool.get("refused_total", 0) == 0, spool


def test_pending_and_acked_then_killed_turns_run_after_the_daemon_restarts(
        short_heartbeat_timeout, fault_stack, tmp_path):
    stack = fault_stack
    connection = stack["connection"]
    stack["daemon"].stop()                       # one agent at a time, so a start can wait in its queue
    daemon = Daemon(stack["portal"], stack["key"], str(stack["workspace"]), tmp_path, sigint_timeout_s=2)
    daemon.args += ["--max-concurrency", "1"]
    daemon.start()
    try:
        wait_until(lambda: Connection.objects.get(pk=connection.pk).capabilities.get("max_concurrency") == 1
                   and Connection.objects.get(pk=connection.pk).status == "online", timeout=30,
                   message="the restarted daemon to say hello")
        first = start(stack, "@sleep 300", idea_key="idea:busy")
        first = wait_turn(first, lambda t: t.status == "running" and t.pid, 30, "the first agent to run")
        status, answer = stack["api"].call("POST", f"/sessions/{first.session_id}/messages", {"prompt": "@reply b"})
        assert status == 200 and answer["queued"] is True, answer
        behind = Turn.objects.get(pk=answer["turn"])       # queued in the portal behind the running turn
        acked = start(stack, "@reply c", idea_key="idea:acked")  # taken by the daemon, waits for capacity
        wait_until(lambda: ControlCommand.objects.filter(turn=acked, state="acked").exists()
                   and str(acked.pk) in (Connection.objects.get(pk=connection.pk).last_snapshot.get("queued") or []),
                   timeout=30, message="the daemon to ack and queue the second session's start")
        daemon.kill()                            # SIGKILL: its queue is lost, and the machine loses the agent
        kill_group(first.pid)
        wait_turn(first, settled_offline, SWEPT_WITHIN_S, "the sweep to settle the running turn offline")
        daemon.start()                           # the daemon restarts (an orphan record is all that is left)
        for turn, reply in ((behind, "b"), (acked, "c")):
            ended = wait_turn(turn, lambda t: t.status == "ended", 60, f"turn {reply} to run after the restart")
            assert ended.final_reply == reply
        assert Event.objects.filter(stream=acked.stream, kind="turn.redispatched", data__id=str(acked.pk)).exists()
        assert ControlCommand.objects.filter(turn=acked, action="start_turn").count() == 2
    finally:
        daemon.stop()
