"""Notifications leave as soon as the failure commits, through the real Celery worker (issue 12
item 2): the beat's scan is set to an hour, so only the after-commit hook (notifications/hooks.py)
can get the email to the local SMTP server and the signed webhook to the local receiver.  The rule
whose receiver is down is retried with doubling backoff (seen in the log as it happens) and logged
failed after the last retry.  No canary secret from the failure reaches any notification."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import transaction

from chorus_site.models import Event
from chorus_site.notifications.delivery import signature_valid
from chorus_site.notifications.models import NotificationCursor, NotificationDelivery, NotificationRule
from sessions_app import bridge
from tests.e2e.conftest import free_port, wait_until
from tests.e2e.test_notifications_e2e import smtp_server, webhook_receiver  # noqa: F401 — fixtures
from tests.sessions_app.test_sweeps import connection, pending_turn  # noqa: F401 — fixtures

pytestmark = [pytest.mark.django_db(transaction=True)]

CANARY = "sk-ant-api03-HookE2Ecanary00000000000SECRET77777"
SECRET = "hook-test-hmac-secret"
RETRIES = 2


@pytest.fixture
def hook_worker_env(monkeypatch, smtp_server):  # noqa: F811
    """Set before the worker starts (it inherits the environment)."""
    controller, _ = smtp_server
    monkeypatch.setenv("EMAIL_HOST", "127.0.0.1")
    monkeypatch.setenv("EMAIL_PORT", str(controller.port))
    monkeypatch.setenv("CHORUS_NOTIFY_SCAN_S", "3600")  # the beat scan cannot be what delivers
    monkeypatch.setenv("CHORUS_NOTIFY_RETRIES", str(RETRIES))
    monkeypatch.setenv("CHORUS_NOTIFY_RETRY_S", "1")
    monkeypatch.setenv("CHORUS_PUBLIC_URL", "https://chorus.example")


def test_a_failed_turn_is_delivered_by_the_worker_on_commit_and_a_down_receiver_backs_off(
        hook_worker_env, celery_beat_worker, smtp_server, webhook_receiver, operator, connection):  # noqa: F811
    _, mailbox = smtp_server
    hook_url, received = webhook_receiver
    latest = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
    NotificationCursor.objects.update_or_create(name="events", defaults={"last_event_id": latest})
    rule = NotificationRule.objects.create(name="auth failures", trigger="turn_failed", wake_error_kind="auth",
                                           email_to="ops@example.com", webhook_url=hook_url, webhook_secret=SECRET)
    down = NotificationRule.objects.create(name="down receiver", trigger="turn_failed",
                                           webhook_url=f"http://127.0.0.1:{free_port()}/hook")
    turn = pending_turn(operator, connection)
    with transaction.atomic():  # as the daemon's report route applies it
        bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "running", "pid": 4242})
    with transaction.atomic():
        bridge._apply_advance(connection, turn.pk, {
            "report_id": str(uuid.uuid4()), "status": "interrupted", "reason": "crash",
            "wake_error": {"kind": "auth", "summary": f"401 invalid x-api-key {CANARY}"}})

    wait_until(lambda: mailbox.messages and received, timeout=30, message="the email and the webhook")

    # Backoff: the log says when the next attempt comes, doubling (RETRY_S=1: 1 s, then 2 s).
    seen: list[str] = []

    def gave_up():
        delivery = NotificationDelivery.objects.get(rule=down)
        if delivery.reason not in seen:
            seen.append(delivery.reason)
        return delivery.state == "failed"

    wait_until(gave_up, timeout=30, interval=0.05, message="the down receiver given up")
    assert [r.split("; ")[-1] for r in seen if "retrying" in r] == ["retrying in 1 s", "retrying in 2 s"], seen
    gave_up_row = NotificationDelivery.objects.get(rule=down)
    assert gave_up_row.attempts == RETRIES + 1 and f"failed after {RETRIES + 1} attempts" in gave_up_row.reason
    assert "unreachable" in gave_up_row.reason

    assert {(d.channel, d.state) for d in NotificationDelivery.objects.filter(rule=rule)} == {
        ("email", "sent"), ("webhook", "sent")}
    assert len(mailbox.messages) == 1 and len(received) == 1
    email = mailbox.messages[0].decode()
    assert f"https://chorus.example/admin/sessions_app/turn/{turn.pk}/change/" in email
    headers, body = received[0]
    assert signature_valid(SECRET, headers["x-chorus-timestamp"], body, headers["x-chorus-signature"])
    assert json.loads(body)["about"] == f"turn:{turn.pk}"
    everything = email + body.decode() + json.dumps([d.payload for d in NotificationDelivery.objects.all()])
    assert CANARY not in everything and "sk-ant-api03-" not in everything
