"""In a real browser, on the real stack (daphne, Celery with beat, chorus_daemon running the scripted
agent): the dashboard's counts change live when a turn fails and when a stop goes unconfirmed, the
turn changelist gains a row live (also one made while the portal was down, once the socket is
back), and a running turn's timer ticks — all without a reload, with a clean CSP (issue 11 items
1-3).  One stack for the whole module: the steps run in one test."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from playwright.sync_api import expect

from sessions_app.models import Turn
from tests import factories
from tests.e2e.conftest import admin_login, start_portal, stop_process, wait_online, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _start(bridge, prompt: str) -> Turn:
    status, body = bridge["api"].call("POST", "/sessions", {
        "connection": str(bridge["connection"].pk), "cwd": str(bridge["workspace"]), "prompt": prompt})
    assert status == 201, body
    return Turn.objects.get(pk=body["turn"])


def _open(context, url, csp_errors):
    page = context.new_page()
    page.on("console", lambda m: "Content Security Policy" in m.text and csp_errors.append(m.text))
    page.goto(url)
    expect(page.locator("#chorus-live-status")).to_have_attribute("data-state", "live", timeout=15_000)
    page.evaluate("window.__noReload = 1")
    return page


def test_dashboard_counts_changelist_rows_and_timers_follow_the_stack_live(bridge, browser, operator, tmp_path):
    portal = bridge["portal"]
    csp_errors: list[str] = []
    context = browser.new_context()  # one sign-in for both pages (signing in again would end the first)
    admin_login(context.new_page(), portal, operator)
    dashboard = _open(context, f"{portal}/admin/", csp_errors)
    failed = dashboard.locator('[data-dash-count="turns_failed_24h"]')
    unconfirmed = dashboard.locator('[data-dash-count="turns_stop_unconfirmed"]')
    expect(failed).to_have_text("0")
    expect(unconfirmed).to_have_text("0")
    expect(dashboard.locator("#chorus-chart-turns")).to_be_visible()
    turns = _open(context, f"{portal}/admin/sessions_app/turn/", csp_errors)

    # A new turn appears in the open changelist, and its timer ticks once it runs.
    long_turn = _start(bridge, "@sleep 300\nLong work")
    row = turns.locator(f'#result_list tr:has(input.action-select[value="{long_turn.pk}"])')
    expect(row).to_have_count(1, timeout=15_000)
    timer = row.locator("time.chorus-timer")
    expect(timer).to_contain_text("running for", timeout=20_000)
    first = timer.inner_text()
    wait_until(lambda: timer.inner_text() != first, timeout=10, message="the timer to tick")
    assert timer.get_attribute("title").startswith("since ")

    # The portal goes away and comes back: a turn made meanwhile (its live message went to nobody)
    # is in the list once the page's socket is back — it re-reads on reconnect.
    stop_process(portal.process)
    expect(turns.locator("#chorus-live-status")).to_have_attribute("data-state", "offline", timeout=15_000)
    missed = factories.make_turn(session=factories.make_session(connection=bridge["connection"]))
    portal.process = start_portal(int(portal.rsplit(":", 1)[1]), tmp_path)
    expect(turns.locator(f'#result_list tr:has(input.action-select[value="{missed.pk}"])')).to_have_count(
        1, timeout=30_000)
    wait_online(bridge["connection"])

    # A failing turn: the dashboard's count moves without a reload.
    crash = _start(bridge, "@stderr failing now\n@exit 3")
    expect(failed).to_have_text("1", timeout=30_000)
    assert Turn.objects.get(pk=crash.pk).interrupted_reason == "crash"

    # A stop nobody confirms (the daemon is frozen): Celery's deadline marks it unconfirmed, live.
    daemon = bridge["daemon"].process
    daemon.send_signal(signal.SIGSTOP)
    try:
        status, _ = bridge["api"].call("POST", f"/turns/{long_turn.pk}/interrupt", {"reason": "e2e"})
        assert status == 200
        expect(unconfirmed).to_have_text("1", timeout=18_000)  # within the heartbeat timeout (20 s)
        expect(row.locator('[data-live-field="stop_state"]')).to_have_text("unconfirmed", timeout=10_000)
    finally:
        daemon.send_signal(signal.SIGCONT)
    # Not asserted here: the thawed daemon's confirmation.  Its report also carries the earlier
    # "signalled" step, which the portal refuses after "unconfirmed" (409), holding the confirmation
    # back — a bridge issue, reported separately.
    assert dashboard.evaluate("window.__noReload") == 1 and turns.evaluate("window.__noReload") == 1
    assert csp_errors == []
    # docs/operators.md's screenshots (CHORUS_DOCS_IMAGES=docs/images), light and dark.
    shots = Path(os.environ.get("CHORUS_DOCS_IMAGES") or tmp_path)
    turns.set_viewport_size({"width": 1900, "height": 700})  # every column, the times and durations too
    for scheme in ("light", "dark"):
        for page in (dashboard, turns):
            page.emulate_media(color_scheme=scheme)
            page.reload()  # the charts take their colours from the theme at load
            expect(page.locator("#chorus-live-status")).to_have_attribute("data-state", "live", timeout=15_000)
        suffix = "" if scheme == "light" else "-dark"
        dashboard.locator("#chorus-dashboard").screenshot(path=str(shots / f"ops-dashboard{suffix}.png"))
        turns.screenshot(path=str(shots / f"ops-turns-live{suffix}.png"))
