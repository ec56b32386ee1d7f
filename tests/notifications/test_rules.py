"""Notification rules (issue 12 item 2): matching and scope, the quiet period and its log, the
offline rule, the admin (ops_admin manages, the secret stays write-only) and the signature.
Delivery through a real SMTP server, webhook receiver and Celery worker: tests/e2e/test_notifications_e2e.py."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from chorus_site.models import AuditEntry
from chorus_site.notifications import rules
from chorus_site.notifications.delivery import signature, signature_valid
from chorus_site.notifications.models import NotificationCursor, NotificationDelivery, NotificationRule
from sessions_app import actions, bridge
from sessions_app.models import Connection, Turn
from tests import factories
from tests.sessions_app.test_sweeps import connection, online, running_turn  # noqa: F401 — fixtures

pytestmark = pytest.mark.django_db

CANARY = "sk-ant-api03-RuleCanary0000000000000SECRET55555"


@pytest.fixture
def cursor():
    NotificationCursor.objects.create(name="events", last_event_id=0)


def fail(connection, turn, kind="auth"):
    bridge._apply_advance(connection, turn.pk, {
        "report_id": str(uuid.uuid4()), "status": "interrupted", "reason": "crash",
        "wake_error": {"kind": kind, "summary": f"401 from the model API, key {CANARY}"}})


def deliveries(**filters):
    return sorted((d.rule.name, d.channel, d.state) for d in NotificationDelivery.objects.filter(**filters))


def test_a_rule_matches_its_kind_and_scope_only(operator, connection, cursor):  # noqa: F811
    other = online(factories.make_connection(cwds=["/srv/work"]))
    NotificationRule.objects.create(name="auth here", trigger="turn_failed", wake_error_kind="auth",
                                    connection=connection, email_to="a@example.com")
    NotificationRule.objects.create(name="auth elsewhere", trigger="turn_failed", wake_error_kind="auth",
                                    connection=other, email_to="b@example.com")
    NotificationRule.objects.create(name="timeouts", trigger="turn_failed", wake_error_kind="timeout",
                                    email_to="c@example.com")
    NotificationRule.objects.create(name="codex only", trigger="turn_failed", backend="codex", email_to="d@example.com")
    NotificationRule.objects.create(name="off", trigger="turn_failed", enabled=False, email_to="e@example.com")
    turn = running_turn(operator, connection)
    fail(connection, turn)
    assert rules.notifications_scan()["deliveries"] == 1
    assert deliveries() == [("auth here", "email", "pending")]
    [delivery] = NotificationDelivery.objects.all()
    assert delivery.about == f"turn:{turn.pk}" and delivery.subject == f"session:{turn.session_id}"
    assert CANARY not in str(delivery.payload) and delivery.payload["facts"]["wake_error"]["kind"] == "auth"
    assert rules.notifications_scan()["deliveries"] == 0  # the cursor moved on: once per event


def test_within_the_quiet_period_a_second_failure_is_suppressed_and_logged(operator, connection, cursor):  # noqa: F811
    rule = NotificationRule.objects.create(name="auth", trigger="turn_failed", email_to="a@example.com",
                                           webhook_url="https://hooks.example/x", quiet_period_s=600)
    first = running_turn(operator, connection)
    fail(connection, first)
    rules.notifications_scan()
    answer = actions.session_message(actor=operator, session_id=first.session_id, prompt="again")
    second = Turn.objects.get(pk=answer["turn"])
    bridge._apply_advance(connection, second.pk, {"report_id": str(uuid.uuid4()), "status": "running", "pid": 99})
    fail(connection, second)
    rules.notifications_scan()
    assert deliveries(about=f"turn:{first.pk}") == [("auth", "email", "pending"), ("auth", "webhook", "pending")]
    assert deliveries(about=f"turn:{second.pk}") == [("auth", "email", "suppressed"), ("auth", "webhook", "suppressed")]
    assert "quiet period" in NotificationDelivery.objects.filter(about=f"turn:{second.pk}").first().reason

    # Past the period the same session notifies again.
    NotificationDelivery.objects.filter(rule=rule).update(created_at=timezone.now() - timedelta(seconds=601))
    happening = rules.happenings_of(
        factories.events_of(f"session:{second.session_id}", kind="turn.status")[-1])[0]
    made = rules.deliveries_create(rule, happening)
    assert {d.state for d in made} == {"pending"}


def test_a_connection_offline_longer_than_n_notifies_once_per_period(connection, cursor):  # noqa: F811
    NotificationRule.objects.create(name="offline 5 min", trigger="connection_offline", older_than_s=300,
                                    email_to="a@example.com", quiet_period_s=3600)
    Connection.objects.filter(pk=connection.pk).update(status="offline",
                                                       last_heartbeat_at=timezone.now() - timedelta(seconds=200))
    assert rules.notifications_scan()["deliveries"] == 0  # not yet 5 minutes
    later = timezone.now() + timedelta(seconds=200)
    assert rules.notifications_scan(now=later)["deliveries"] == 1
    assert rules.notifications_scan(now=later + timedelta(seconds=10))["deliveries"] == 0  # no suppressed spam
    assert deliveries() == [("offline 5 min", "email", "pending")]


def test_stalled_and_unconfirmed_turns_and_failed_runs_are_happenings(operator, connection, cursor):  # noqa: F811
    from executions.services import run_set_state
    from sessions_app import stalls

    for trigger in ("turn_stalled", "stop_unconfirmed", "run_failed"):
        NotificationRule.objects.create(name=trigger, trigger=trigger, email_to="a@example.com")
    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=5)
    turn = running_turn(operator, connection)
    stalls.turns_sweep_stalled(now=timezone.now() + timedelta(seconds=10))
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    actions.stops_settle_overdue(now=timezone.now() + timedelta(hours=1))
    run = factories.make_run_graph(run_state="running")[0]
    run_set_state(run_id=run.pk, state="partial_succeeded")
    rules.notifications_scan()
    assert deliveries() == [("run_failed", "email", "pending"), ("stop_unconfirmed", "email", "pending"),
                            ("turn_stalled", "email", "pending")]
    assert NotificationDelivery.objects.get(rule__name="run_failed").about == f"run:{run.pk}"


def test_the_webhook_signature_is_hmac_of_timestamp_and_body():
    body = b'{"a":1}'
    header = signature("k", "1700000000", body)
    assert header.startswith("sha256=") and signature_valid("k", "1700000000", body, header)
    assert not signature_valid("k", "1700000001", body, header) and not signature_valid("k", "1700000000", b"{}", header)


def test_only_ops_admin_manages_rules_the_secret_stays_write_only_and_changes_are_audited(
        client, operator, viewer, ops_admin_user):
    add = "/admin/notifications/notificationrule/add/"
    client.force_login(operator)
    assert client.get(add).status_code == 403
    client.force_login(ops_admin_user)
    response = client.post(add, {"name": "auth", "enabled": "on", "trigger": "turn_failed", "wake_error_kind": "auth",
                                 "older_than_s": "0", "email_to": "ops@example.com",
                                 "webhook_url": "https://hooks.example/x", "webhook_secret": "s3cret-hmac",
                                 "quiet_period_s": "600", "backend": "", "workflow": ""})
    assert response.status_code == 302, response.content.decode()[:3000]
    rule = NotificationRule.objects.get(name="auth")
    assert rule.webhook_secret == "s3cret-hmac"
    assert AuditEntry.objects.filter(action="notification_rule.add", target=f"notification_rule:{rule.pk}").exists()
    change = f"/admin/notifications/notificationrule/{rule.pk}/change/"
    assert "s3cret-hmac" not in client.get(change).content.decode()
    client.post(change, {"name": "auth", "enabled": "on", "trigger": "turn_failed", "wake_error_kind": "auth",
                         "older_than_s": "0", "email_to": "ops@example.com", "webhook_url": "https://hooks.example/x",
                         "webhook_secret": "", "quiet_period_s": "900", "backend": "", "workflow": ""})
    rule.refresh_from_db()
    assert rule.quiet_period_s == 900 and rule.webhook_secret == "s3cret-hmac"  # kept when left empty
    client.force_login(viewer)
    page = client.get(change)
    assert page.status_code == 200 and "s3cret-hmac" not in page.content.decode()
    assert client.get("/admin/notifications/notificationdelivery/").status_code == 200


def test_an_approval_waiting_longer_than_n_notifies_once_per_period(cursor):
    from executions.models import Approval

    run, node, _task, _attempt = factories.make_run_graph()
    approval = factories.make_approval(node=node, prompt="Ship it?")
    Approval.objects.filter(pk=approval.pk).update(created_at=timezone.now() - timedelta(seconds=100))
    NotificationRule.objects.create(name="approvals 10 min", trigger="approval_waiting", older_than_s=600,
                                    email_to="a@example.com")
    assert rules.notifications_scan()["deliveries"] == 0
    later = timezone.now() + timedelta(seconds=600)
    assert rules.notifications_scan(now=later)["deliveries"] == 1
    assert rules.notifications_scan(now=later + timedelta(seconds=5))["deliveries"] == 0
    [delivery] = NotificationDelivery.objects.all()
    assert delivery.about == f"approval:{approval.pk}" and delivery.payload["facts"]["run"] == str(run.pk)
    Approval.objects.filter(pk=approval.pk).update(status="approved")
    NotificationDelivery.objects.update(created_at=timezone.now() - timedelta(days=1))
    assert rules.notifications_scan(now=later + timedelta(hours=2))["deliveries"] == 0  # decided: nothing waits


def test_a_daemon_key_used_from_another_host_notifies(connection, cursor):  # noqa: F811
    NotificationRule.objects.create(name="new host", trigger="key_new_host", email_to="a@example.com")
    Connection.objects.filter(pk=connection.pk).update(host="worker-1")
    bridge.connection_daemon_connected(connection_id=connection.pk, hello={"version": "0.1.0", "host": "worker-1"})
    assert rules.notifications_scan()["deliveries"] == 0  # the same machine as before
    bridge.connection_daemon_connected(connection_id=connection.pk, hello={"version": "0.1.0", "host": "laptop-x"})
    assert rules.notifications_scan()["deliveries"] == 1
    [delivery] = NotificationDelivery.objects.all()
    assert delivery.about == f"connection:{connection.pk}"
    assert delivery.payload["facts"]["host"] == "laptop-x" and delivery.payload["facts"]["previous_host"] == "worker-1"


def test_a_turn_waiting_for_an_answer_longer_than_n_notifies(operator, connection, cursor):  # noqa: F811
    NotificationRule.objects.create(name="answers 15 min", trigger="answer_waiting", older_than_s=900,
                                    email_to="a@example.com")
    turn = running_turn(operator, connection)
    bridge._apply_advance(connection, turn.pk, {
        "report_id": str(uuid.uuid4()), "status": "requires_action",
        "requires_action": {"kind": "confirmation", "items": [{"id": "r1", "text": "Run the migration?"}]}})
    assert rules.notifications_scan()["deliveries"] == 0
    assert rules.notifications_scan(now=timezone.now() + timedelta(seconds=901))["deliveries"] == 1
    [delivery] = NotificationDelivery.objects.all()
    assert delivery.about == f"turn:{turn.pk}" and "Run the migration?" in delivery.payload["summary"]


def test_the_workflow_scope_matches_turns_of_that_workflows_runs(operator, connection, cursor):  # noqa: F811
    from executions.models import Run, WorkflowDefinition, WorkflowRevision

    definition = WorkflowDefinition.objects.create(name="nightly-fix")
    revision = WorkflowRevision.objects.create(workflow=definition, number=1, spec={})
    run, _node, _task, attempt = factories.make_run_graph()
    Run.objects.filter(pk=run.pk).update(workflow_revision=revision)
    NotificationRule.objects.create(name="nightly", trigger="turn_failed", workflow="nightly-fix", email_to="a@x.com")
    NotificationRule.objects.create(name="other", trigger="turn_failed", workflow="release", email_to="b@x.com")
    in_run = running_turn(operator, connection)
    Turn.objects.filter(pk=in_run.pk).update(attempt_id=attempt.pk)
    fail(connection, in_run)
    rules.notifications_scan()
    assert deliveries() == [("nightly", "email", "pending")]


def test_a_webhook_url_is_a_credential_viewers_see_only_its_host_and_only_http_is_accepted(
        client, viewer, ops_admin_user):
    """Chat services' webhook URLs carry their token in the path: only ops_admin (who sets them)
    reads the whole URL; everyone else, on the rule and in the delivery log, its scheme and host.
    And a webhook is an HTTP(S) POST: ftp:// and the like are refused when the rule is saved."""
    secret_path = "/services/T000/B000/XXXXsecretXXXX"
    rule = NotificationRule.objects.create(name="chat", trigger="turn_failed", webhook_url="https://hooks.example" + secret_path)
    delivery = NotificationDelivery.objects.create(rule=rule, channel="webhook", about="turn:x", subject="s",
                                                   target=rule.webhook_url, payload={})
    client.force_login(viewer)
    for url in (f"/admin/notifications/notificationrule/{rule.pk}/change/",
                "/admin/notifications/notificationrule/",
                f"/admin/notifications/notificationdelivery/{delivery.pk}/change/",
                "/admin/notifications/notificationdelivery/"):
        page = client.get(url)
        assert page.status_code == 200, url
        assert "XXXXsecretXXXX" not in page.content.decode(), url
    assert "hooks.example" in client.get(f"/admin/notifications/notificationrule/{rule.pk}/change/").content.decode()
    client.force_login(ops_admin_user)
    form = {"name": "ftp", "enabled": "on", "trigger": "turn_failed", "wake_error_kind": "", "older_than_s": "0",
            "email_to": "", "webhook_url": "ftp://files.example/drop", "webhook_secret": "", "quiet_period_s": "600",
            "backend": "", "workflow": ""}
    response = client.post("/admin/notifications/notificationrule/add/", form)
    assert response.status_code == 200 and not NotificationRule.objects.filter(name="ftp").exists()
