"""Content-Security-Policy and offline API docs, in a real browser (issue 8 item 9).

/api/v1/docs renders Swagger UI from django-ninja's bundled assets with every non-loopback
request aborted; the main admin pages carry a CSP header and run without a single CSP violation
(no inline script or style left, live updates still connect).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from django.test import Client
from playwright.sync_api import expect

from tests import factories
from tests.e2e.conftest import admin_login

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


def _offline(page, blocked: list[str]):
    def route(route):
        host = urlsplit(route.request.url).hostname or ""
        if host in LOOPBACK:
            return route.continue_()
        blocked.append(route.request.url)
        return route.abort()

    page.route("**/*", route)


def _csp_violations(page) -> list[str]:
    found: list[str] = []
    page.on("console", lambda message: found.append(message.text)
            if "Content Security Policy" in message.text or "Content-Security-Policy" in message.text else None)
    return found


def test_admin_pages_send_a_csp_header(viewer):
    client = Client()
    client.force_login(viewer)
    for url in ("/admin/login/", "/admin/", "/admin/sessions_app/session/"):
        policy = client.get(url).headers.get("Content-Security-Policy", "")
        assert "default-src 'self'" in policy and "unsafe-inline" not in policy, url


def test_api_docs_render_with_no_network(portal_server, browser):
    page = browser.new_page()
    blocked: list[str] = []
    _offline(page, blocked)
    violations = _csp_violations(page)
    page.goto(f"{portal_server}/api/v1/docs")
    # Swagger UI drew the operations of our schema: it loaded its bundle and the OpenAPI locally.
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("Chorus Ops API", timeout=20_000)
    expect(page.locator(".opblock").first).to_be_visible()
    assert page.locator(".opblock").count() > 20
    assert blocked == [] and violations == []


def test_main_admin_pages_have_no_csp_violations(portal_server, browser, viewer):
    turn = factories.make_turn()
    page = browser.new_page()
    blocked: list[str] = []
    _offline(page, blocked)
    violations = _csp_violations(page)
    admin_login(page, portal_server, viewer)
    for path in ("/admin/", "/admin/sessions_app/turn/", f"/admin/sessions_app/session/{turn.session_id}/change/",
                 f"/admin/sessions_app/turn/{turn.pk}/change/"):
        page.goto(portal_server + path)
        expect(page.locator("#content")).to_be_visible()
        if page.locator("#chorus-live-status").count():
            # live.js ran and its WebSocket connected: script-src and connect-src allow our own.
            expect(page.locator("#chorus-live-status")).to_have_attribute("data-state", "live", timeout=10_000)
    assert violations == [], violations
    assert blocked == []
