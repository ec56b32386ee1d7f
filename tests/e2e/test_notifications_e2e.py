"""Notifications end to end (issue 12 item 2): a rule "turn failed with kind auth" and a real turn
failing on a refused key through the real daemon; the Celery worker's beat scans the event log and
delivers to a real local SMTP server (aiosmtpd) and a real local webhook receiver; a second failure
within the quiet period is suppressed and logged; a receiver that is down is retried and logged
failed after the last retry; the canary secret the agent printed is in no notification."""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from chorus_site.models import Event
from chorus_site.notifications.delivery import signature_valid
from chorus_site.notifications.models import NotificationCursor, NotificationDelivery, NotificationRule
from sessions_app.models import Turn
from tests.e2e.conftest import admin_login, free_port, wait_until
from tests.e2e.test_bridge_e2e import start, wait_status

pytestmark = [pytest.mark.django_db(transaction=True)]

CANARY = "sk-ant-api03-NotifyE2Ecanary000000000SECRET44444"
SECRET = "webhook-hmac-secret-for-the-test"
RETRIES = 2


class Mailbox:
    def __init__(self):
        self.messages: list[bytes] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 — aiosmtpd's handler hook
        self.messages.append(envelope.content)
        return "250 OK"


@pytest.fixture
def smtp_server():
    mailbox = Mailbox()
    controller = Controller(mailbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    try:
        yield controller, mailbox
    finally:
        controller.stop()


@pytest.fixture
def webhook_receiver():
    received: list[tuple[dict, bytes]] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 — http.server's hook
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def notify_env(monkeypatch, smtp_server):
    """Set before the portal and the worker start (they inherit the environment)."""
    controller, _ = smtp_server
    monkeypatch.setenv("EMAIL_HOST", "127.0.0.1")
    monkeypatch.setenv("EMAIL_PORT", str(controller.port))
    monkeypatch.setenv("CHORUS_NOTIFY_RETRIES", str(RETRIES))
    monkeypatch.setenv("CHORUS_NOTIFY_RETRY_S", "0")
    monkeypatch.setenv("CHORUS_PUBLIC_URL", "https://chorus.example")


def fail_on_auth(bridge, **extra) -> Turn:
    # The refused key is printed by the agent (from a file: no prompt carries it).
    (bridge["workspace"] / "auth.jsonl").write_text(json.dumps(
        {"type": "error", "kind": "auth", "message": f"401 invalid x-api-key {CANARY}"}) + "\n")
    return start(bridge, "@cat auth.jsonl\n@exit 1", acknowledge_changes=True, **extra)


def test_a_failed_turn_notifies_once_by_email_and_signed_webhook_then_suppresses_and_retries(
        notify_env, smtp_server, webhook_receiver, bridge, browser, operator, tmp_path):
    _, mailbox = smtp_server
    hook_url, received = webhook_receiver
    latest = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
    NotificationCursor.objects.update_or_create(name="events", defaults={"last_event_id": latest})
    rule = NotificationRule.objects.create(name="auth failures", trigger="turn_failed", wake_error_kind="auth",
                                           email_to="ops@example.com", webhook_url=hook_url, webhook_secret=SECRET,
                                           quiet_period_s=3600)
    down = NotificationRule.objects.create(name="to a receiver that is down", trigger="turn_failed",
                                           webhook_url=f"http://127.0.0.1:{free_port()}/hook", quiet_period_s=3600)

    first = wait_status(fail_on_auth(bridge, idea_key="idea:notify"), "interrupted")
    assert first.wake_error["kind"] == "auth"
    wait_until(lambda: mailbox.messages and received, timeout=40, message="the email and the webhook")
    status, answer = bridge["api"].call("POST", f"/sessions/{first.session_id}/messages",
                                        {"prompt": "@cat auth.jsonl\n@exit 1"})
    assert status == 200, answer
    second = wait_status(Turn.objects.get(pk=answer["turn"]), "interrupted")
    assert second.wake_error["kind"] == "auth"

    def logged():
        rows = list(NotificationDelivery.objects.filter(about=f"turn:{second.pk}"))
        failed = NotificationDelivery.objects.filter(rule=down, about=f"turn:{first.pk}", state="failed").exists()
        return rows if len(rows) == 3 and failed else None

    wait_until(logged, timeout=60, message="the second failure logged and the down receiver given up")

    sent = {(d.channel, d.state) for d in NotificationDelivery.objects.filter(rule=rule, about=f"turn:{first.pk}")}
    assert sent == {("email", "sent"), ("webhook", "sent")}
    suppressed = NotificationDelivery.objects.filter(about=f"turn:{second.pk}")
    assert {(d.rule_id, d.channel, d.state) for d in suppressed} == {
        (rule.pk, "email", "suppressed"), (rule.pk, "webhook", "suppressed"), (down.pk, "webhook", "suppressed")}
    assert all("quiet period" in d.reason for d in suppressed)
    gave_up = NotificationDelivery.objects.get(rule=down, about=f"turn:{first.pk}")
    assert gave_up.attempts == RETRIES + 1 and f"failed after {RETRIES + 1} attempts" in gave_up.reason

    assert len(mailbox.messages) == 1 and len(received) == 1  # one failed turn notified, once per channel
    email = mailbox.messages[0].decode()
    assert "ops@example.com" in email and f"https://chorus.example/admin/sessions_app/turn/{first.pk}/change/" in email
    headers, body = received[0]
    assert signature_valid(SECRET, headers["x-chorus-timestamp"], body, headers["x-chorus-signature"])
    assert not signature_valid("another secret", headers["x-chorus-timestamp"], body, headers["x-chorus-signature"])
    payload = json.loads(body)
    assert payload["about"] == f"turn:{first.pk}" and payload["facts"]["wake_error"]["kind"] == "auth"
    everything = email + body.decode() + json.dumps([d.payload for d in NotificationDelivery.objects.all()])
    assert CANARY not in everything and "sk-ant-api03-" not in everything

    # The delivery log in the admin, as an operator reads it (docs/alerts.md's screenshot).
    page = browser.new_page()
    admin_login(page, bridge["portal"], operator)
    page.goto(f"{bridge['portal']}/admin/notifications/notificationdelivery/")
    log = page.locator("#result_list").inner_text()
    assert log.count("suppressed") == 3 and "failed after 3 attempts" in log and log.count("sent") >= 2
    assert CANARY not in page.content()
    page.screenshot(path=str(Path(os.environ.get("CHORUS_DOCS_IMAGES") or tmp_path) / "alerts-deliveries.png"),
                    full_page=True)
    page.close()
