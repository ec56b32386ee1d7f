"""Stall detection end to end (issue 12 item 1): a real portal, a real daemon spawning the scripted
agent, a real Celery worker with beat running the stall sweep.  An agent silent past a 2 s threshold
is flagged stalled with the daemon's evidence (waiting on a child, the child's command line
redacted); output resumes and the flag clears while the turn still runs; the turn page shows it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chorus_site.models import Event
from sessions_app.models import Connection, Turn
from tests.e2e.conftest import admin_login, wait_until
from tests.e2e.test_bridge_e2e import start, wait_status

pytestmark = [pytest.mark.django_db(transaction=True)]

CANARY = "sk-ant-api03-StallE2Ecanary00000000SECRET33333"
THRESHOLD_S = 2
# Threshold + one sweep (CHORUS_STALL_SWEEP_S, 5 s) + one heartbeat (5 s) for the daemon's sample,
# with room for a loaded machine; a deadline to wait on, not a timing assert (docs/benchmarks.md).
DEADLINE_S = 45


def flagged(turn):
    return wait_until(lambda: (t := Turn.objects.get(pk=turn.pk)).stalled_at is not None and t,
                      timeout=DEADLINE_S, message="the turn flagged stalled")


def test_a_silent_agent_waiting_on_a_child_is_flagged_with_evidence_and_clears_when_output_resumes(
        bridge, browser, operator, tmp_path):
    shots = Path(os.environ.get("CHORUS_DOCS_IMAGES") or tmp_path)  # docs/alerts.md's screenshots
    Connection.objects.filter(pk=bridge["connection"].pk).update(stall_threshold_s=THRESHOLD_S)
    # The child's command line carries a canary: the evidence shows the command, never the secret.
    turn = start(bridge, f"@write a.txt before\n@wait-child 20 --api-key={CANARY}\n@sleep 4\n@reply done",
                 acknowledge_changes=True)
    wait_status(turn, "running")
    turn = flagged(turn)
    assert turn.status == "running"  # a flag, not a state
    assert turn.stall_evidence["threshold_s"] == THRESHOLD_S
    assert turn.stall_evidence["last_tool_call"]["name"] == "write"

    def sampled():
        t = Turn.objects.get(pk=turn.pk)
        process = (t.stall_evidence or {}).get("process") or {}
        return t if process.get("state") == "waiting_on_child" and process.get("children") else None

    turn = wait_until(sampled, timeout=DEADLINE_S, message="the daemon's sample: waiting on a child")
    cmdlines = " ".join(c["cmdline"] for c in turn.stall_evidence["process"]["children"])
    assert "--api-key=" in cmdlines and "time.sleep(20" in cmdlines
    assert CANARY not in str(turn.stall_evidence)

    page = browser.new_page()
    admin_login(page, bridge["portal"], operator)
    page.goto(f"{bridge['portal']}/admin/sessions_app/turn/{turn.pk}/change/")
    summary = page.locator("#chorus-stall-summary").inner_text()
    assert "waiting on a child process" in summary
    assert "--api-key=" in page.locator("#chorus-stall-children").inner_text()
    assert CANARY not in page.content()
    page.locator("#chorus-stall").screenshot(path=str(shots / "alerts-stalled-turn.png"))
    page.goto(f"{bridge['portal']}/admin/sessions_app/turn/?stalled=yes")
    assert page.locator(f'[data-live-id="{turn.pk}"][data-live-field="stalled"]').inner_text() == "stalled"
    page.screenshot(path=str(shots / "alerts-stalled-filter.png"), full_page=True)

    # The child ends, the agent prints again (its @sleep's progress lines): the flag clears while the
    # turn still runs, and the changelist filtered on "stalled" follows live.
    cleared = wait_until(lambda: (t := Turn.objects.get(pk=turn.pk)).stalled_at is None and t,
                         timeout=DEADLINE_S, message="the flag cleared")
    assert cleared.stall_evidence["cleared_by"] == "output"
    page.wait_for_selector(f'[data-live-id="{turn.pk}"][data-live-field="stalled"]', state="detached",
                           timeout=DEADLINE_S * 1000)
    kinds = [e.kind for e in Event.objects.filter(stream=turn.stream, data__id=str(turn.pk),
                                                  kind__in=["turn.stalled", "turn.unstalled"]).order_by("id")]
    assert kinds == ["turn.stalled", "turn.unstalled"]
    assert wait_status(turn, "ended").final_reply == "done"
    page.close()
