"""The after-commit hook that queues the scan (notifications/hooks.py), the retry backoff, and who
may do what with rules and the delivery log.  Through the real worker:
tests/e2e/test_notification_hooks_e2e.py."""

from __future__ import annotations

import email
import email.policy
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from chorus_site.models import AuditEntry, Event
from chorus_site.notifications import hooks, rules
from chorus_site.notifications.models import NotificationCursor, NotificationDelivery, NotificationRule
from chorus_site.notifications.tasks import notifications_scan_now, retry_countdown
from sessions_app import actions, bridge
from sessions_app.models import Connection
from tests import factories
from tests.e2e.test_notifications_e2e import smtp_server  # noqa: F401 — fixture (a real aiosmtpd server)
from tests.sessions_app.test_sweeps import connection, running_turn  # noqa: F401 — fixtures

pytestmark = pytest.mark.django_db

CANARY = "sk-ant-api03-HookUnitCanary0000000000SECRET66666"


def fail(connection, turn, kind="auth"):  # noqa: F811
    bridge._apply_advance(connection, turn.pk, {
        "report_id": str(uuid.uuid4()), "status": "interrupted", "reason": "crash",
        "wake_error": {"kind": kind, "summary": f"401 from the model API, key {CANARY}"}})


def queued_scans(callbacks) -> int:
    """How many captured after-commit callbacks queue the scan (chorus_site.scheduling's closure)."""
    return sum(1 for c in callbacks for cell in (c.__closure__ or ()) if cell.cell_contents is notifications_scan_now)


def test_a_failed_turn_queues_one_scan_after_commit_and_a_running_one_none(
        operator, connection, django_capture_on_commit_callbacks):  # noqa: F811
    with django_capture_on_commit_callbacks() as started:
        turn = running_turn(operator, connection)
    assert queued_scans(started) == 0
    with django_capture_on_commit_callbacks() as failed:
        fail(connection, turn)
    assert queued_scans(failed) == 1


def test_every_event_that_makes_a_happening_is_seen_by_the_hook(operator, connection):  # noqa: F811
    """The hook's cheap test never misses what the scan would notify (else it waits for the beat)."""
    from executions.services import run_set_state
    from sessions_app import stalls

    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=5)
    turn = running_turn(operator, connection)
    stalls.turns_sweep_stalled(now=timezone.now() + timedelta(seconds=10))
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    actions.stops_settle_overdue(now=timezone.now() + timedelta(hours=1))
    other = running_turn(operator, connection)
    fail(connection, other)
    run = factories.make_run_graph(run_state="running")[0]
    run_set_state(run_id=run.pk, state="failed")
    events = list(Event.objects.filter(kind__in=rules.SCAN_KINDS))
    made = [e for e in events if rules.happenings_of(e)]
    assert {e.kind for e in made} == {"turn.status", "turn.stalled", "turn.stop_state", "run.state"}
    assert all(hooks.notifiable(e.kind, e.data) for e in made)
    assert not any(hooks.notifiable(e.kind, e.data) for e in events if not rules.happenings_of(e))


def test_the_kicked_scan_is_the_scan(operator, connection):  # noqa: F811
    NotificationCursor.objects.create(name="events", last_event_id=0)
    NotificationRule.objects.create(name="auth", trigger="turn_failed", email_to="a@example.com")
    fail(connection, running_turn(operator, connection))
    assert notifications_scan_now.apply().get()["deliveries"] == 1
    assert notifications_scan_now.apply().get()["deliveries"] == 0  # the cursor is shared with the beat's


def test_retries_back_off_doubling(settings):
    settings.CHORUS_NOTIFY_RETRY_S = 30
    assert [retry_countdown(n) for n in range(4)] == [30, 60, 120, 240]


RULES = "/admin/notifications/notificationrule/"
LOG = "/admin/notifications/notificationdelivery/"


def rule_form(**extra) -> dict:
    return {"name": "auth", "enabled": "on", "trigger": "turn_failed", "wake_error_kind": "auth",
            "older_than_s": "0", "email_to": "ops@example.com", "webhook_url": "", "webhook_secret": "",
            "quiet_period_s": "600", "backend": "", "workflow": "", **extra}


@pytest.mark.parametrize("persona", ["outsider", "viewer", "operator", "diagnostics_reader", "ops_admin_user"])
def test_only_ops_admin_adds_changes_and_deletes_rules(client, personas, persona):
    rule = NotificationRule.objects.create(name="existing", trigger="turn_stalled", email_to="a@example.com")
    client.force_login(personas[persona])
    may_manage = persona == "ops_admin_user"
    assert client.get(RULES).status_code == (403 if persona == "outsider" else 200)
    added = client.post(f"{RULES}add/", rule_form())
    assert added.status_code == (302 if may_manage else 403)
    assert NotificationRule.objects.filter(name="auth").exists() is may_manage
    client.post(f"{RULES}{rule.pk}/change/", rule_form(name="existing", trigger="turn_stalled", quiet_period_s="5"))
    rule.refresh_from_db()
    assert (rule.quiet_period_s == 5) is may_manage
    deleted = client.post(f"{RULES}{rule.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == (302 if may_manage else 403)
    assert NotificationRule.objects.filter(pk=rule.pk).exists() is not may_manage
    audited = set(AuditEntry.objects.filter(action__startswith="notification_rule.").values_list("action", flat=True))
    assert audited == ({"notification_rule.add", "notification_rule.change", "notification_rule.delete"}
                       if may_manage else set())


@pytest.mark.parametrize("persona", ["outsider", "viewer", "operator", "diagnostics_reader", "ops_admin_user"])
def test_the_delivery_log_is_read_only_for_everyone(client, personas, persona):
    rule = NotificationRule.objects.create(name="r", trigger="turn_failed", email_to="a@example.com")
    delivery = NotificationDelivery.objects.create(rule=rule, subject="session:x", about="turn:x", channel="email",
                                                   target="a@example.com", state="failed", reason="refused")
    client.force_login(personas[persona])
    readable = persona != "outsider"
    assert client.get(LOG).status_code == (200 if readable else 403)
    page = client.get(f"{LOG}{delivery.pk}/change/")
    assert page.status_code == (200 if readable else 403)
    assert client.get(f"{LOG}add/").status_code == 403
    client.post(f"{LOG}{delivery.pk}/change/", {"state": "sent", "reason": ""})
    assert client.post(f"{LOG}{delivery.pk}/delete/", {"post": "yes"}).status_code == 403
    delivery.refresh_from_db()
    assert (delivery.state, delivery.reason) == ("failed", "refused")


def test_a_bulk_delete_and_every_change_are_audited_with_what_changed_never_the_secret(client, ops_admin_user):
    client.force_login(ops_admin_user)
    rule = NotificationRule.objects.create(name="existing", trigger="turn_stalled", email_to="a@example.com")
    client.post(f"{RULES}{rule.pk}/change/", rule_form(name="existing", trigger="turn_stalled", quiet_period_s="5",
                                                      webhook_url="https://hooks.example/x",
                                                      webhook_secret="new-hmac-secret-value"))
    [change] = AuditEntry.objects.filter(action="notification_rule.change", target=f"notification_rule:{rule.pk}")
    assert {"quiet_period_s", "webhook_url", "webhook_secret"} <= set(change.outcome.removeprefix("changed ").split(", "))
    assert "new-hmac-secret-value" not in change.outcome + change.reason

    # The changelist's "delete selected" action goes around delete_model.
    answer = client.post(RULES, {"action": "delete_selected", "_selected_action": [str(rule.pk)], "post": "yes"})
    assert answer.status_code == 302 and not NotificationRule.objects.filter(pk=rule.pk).exists()
    assert AuditEntry.objects.filter(action="notification_rule.delete", target=f"notification_rule:{rule.pk}").exists()


@pytest.mark.parametrize("value, ids", [
    ("https://chorus.example", set()), ("https://chorus.example/ops", set()),
    ("chorus.example", {"notifications.E001"}), ("ftp://chorus.example", {"notifications.E001"}),
    ("", set()),
])
def test_the_public_url_of_links_is_checked(settings, value, ids):
    from django.core import checks

    settings.CHORUS_PUBLIC_URL = value
    found = {m.id for m in checks.run_checks(include_deployment_checks=True) if m.id.startswith("notifications.")}
    assert found == ids


def test_an_issue_waiting_for_review_longer_than_n_notifies_once_and_stops_when_decided():
    import json

    from executions.services import issue_set_status

    NotificationCursor.objects.create(name="events", last_event_id=0)
    rule = NotificationRule.objects.create(name="review 1 h", trigger="review_waiting", older_than_s=3600,
                                           email_to="leads@example.com", quiet_period_s=86400)
    NotificationRule.objects.create(name="nightly only", trigger="review_waiting", workflow="nightly",
                                    email_to="night@example.com")
    issue = factories.make_issue(status="in_progress", title=f"Fix the login with {CANARY}")
    issue_set_status(issue_id=issue.pk, status="in_review")
    assert rules.notifications_scan()["deliveries"] == 0  # not yet an hour
    later = timezone.now() + timedelta(seconds=3601)
    assert rules.notifications_scan(now=later)["deliveries"] == 1
    assert rules.notifications_scan(now=later + timedelta(seconds=10))["deliveries"] == 0  # a state: no spam
    [delivery] = NotificationDelivery.objects.all()
    assert delivery.rule == rule and delivery.about == f"issue:{issue.pk}" and delivery.state == "pending"
    assert delivery.payload["url"].endswith(f"/admin/executions/issue/{issue.pk}/change/")
    assert CANARY not in json.dumps(delivery.payload)
    issue_set_status(issue_id=issue.pk, status="done")  # accepted: nothing waits any more
    assert rules.notifications_scan(now=later + timedelta(days=2))["deliveries"] == 0


def test_an_agent_summary_with_line_breaks_still_makes_a_one_line_subject(settings, smtp_server, operator,  # noqa: F811
                                                                           connection):  # noqa: F811
    """The wake error's summary is agent text; a newline in an email header is refused outright
    (BadHeaderError), so it would fail every retry and the email would never leave."""
    from chorus_site.notifications.delivery import send

    controller, mailbox = smtp_server
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", controller.port
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    NotificationCursor.objects.create(name="events", last_event_id=0)
    NotificationRule.objects.create(name="auth", trigger="turn_failed", email_to="ops@example.com")
    turn = running_turn(operator, connection)
    bridge._apply_advance(connection, turn.pk, {
        "report_id": str(uuid.uuid4()), "status": "interrupted", "reason": "crash",
        "wake_error": {"kind": "auth", "summary": "401 Unauthorized\r\nBcc: everyone@example.com\n\nplease log in"}})
    rules.notifications_scan()
    send(NotificationDelivery.objects.get())
    [raw] = mailbox.messages
    message = email.message_from_bytes(raw, policy=email.policy.default)
    assert "failed: auth: 401 Unauthorized Bcc: everyone@example.com please log in" in message["Subject"]
    assert message["Bcc"] is None and message["To"] == "ops@example.com"  # no header smuggled in
