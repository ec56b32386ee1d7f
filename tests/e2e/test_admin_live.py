"""In a real browser: the admin shows live status changes without a reload (SPEC §10)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from chorus_site.models import AuditEntry
from sessions_app import services
from tests import factories
from tests.e2e.conftest import admin_login

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_turn_badge_changes_live_on_the_session_page(portal_server, browser, viewer, tmp_path):
    turn = factories.make_turn()
    page = browser.new_page()
    admin_login(page, portal_server, viewer)
    page.goto(f"{portal_server}/admin/sessions_app/session/{turn.session_id}/change/")
    badge = page.locator(f'[data-live-id="{turn.pk}"][data-live-field="status"]').first
    expect(badge).to_have_text("pending")
    expect(page.locator("#chorus-live-status")).to_have_attribute("data-state", "live", timeout=10_000)
    marker = page.evaluate("window.__chorusMarker = 42")

    services.turn_set_status(turn_id=turn.pk, status="running")
    expect(badge).to_have_text("running", timeout=10_000)
    services.turn_set_status(turn_id=turn.pk, status="interrupted", reason="user")
    expect(badge).to_have_text("interrupted (user)", timeout=10_000)
    assert page.evaluate("window.__chorusMarker") == 42 == marker  # same page: no reload happened
    # The timeline grew in place too.
    expect(page.locator("#chorus-timeline tr[data-event-id]").first).to_contain_text("turn.status")
    page.screenshot(path=str(tmp_path / "session-live.png"), full_page=True)


def test_viewer_sees_summary_and_diagnostics_reader_sees_masked_details(portal_server, browser, viewer,
                                                                         diagnostics_reader):
    secret = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    turn = factories.make_turn()
    services.turn_set_status(turn_id=turn.pk, status="running")
    services.turn_set_status(turn_id=turn.pk, status="interrupted", reason="crash", wake_error={
        "kind": "exited_nonzero", "exit_code": 3, "summary": "agent exited with code 3",
        "details": f"cloning with GITHUB_TOKEN={secret}\nfatal: error"})
    url = f"{portal_server}/admin/sessions_app/turn/{turn.pk}/change/"

    page = browser.new_page()
    admin_login(page, portal_server, viewer)
    page.goto(url)
    expect(page.locator("#wake-error-summary")).to_have_text("agent exited with code 3")
    expect(page.locator("#wake-error-withheld")).to_be_visible()
    assert page.locator("#wake-error-details").count() == 0
    assert secret not in page.content()

    reader = browser.new_page()
    admin_login(reader, portal_server, diagnostics_reader)
    reader.goto(url)
    details = reader.locator("#wake-error-details")
    expect(details).to_contain_text("fatal: error")
    expect(details).to_contain_text("[REDACTED]")
    assert secret not in reader.content()
    assert AuditEntry.objects.filter(actor=diagnostics_reader.username, action="diagnostics.view",
                                     target=f"turn:{turn.pk}").count() == 1


def test_outsider_sees_no_ops_sections(portal_server, browser, outsider):
    page = browser.new_page()
    admin_login(page, portal_server, outsider)
    content = page.content()
    assert "Sessions" not in content and "Executions" not in content
    response = page.goto(f"{portal_server}/admin/sessions_app/session/")
    assert response.status == 403


def test_operator_sends_a_message_from_the_session_page(portal_server, browser, operator):
    from django.utils import timezone

    from sessions_app.models import Connection, Turn

    session = factories.make_session()
    Connection.objects.filter(pk=session.connection_id).update(status="online", last_heartbeat_at=timezone.now())
    page = browser.new_page()
    admin_login(page, portal_server, operator)
    page.goto(f"{portal_server}/admin/sessions_app/session/{session.pk}/change/")
    page.fill("#id_prompt", "please add tests")
    page.click("#chorus-send")
    expect(page.locator(".messagelist")).to_contain_text("Sent to the daemon")
    assert Turn.objects.filter(session=session, prompt="please add tests").count() == 1
