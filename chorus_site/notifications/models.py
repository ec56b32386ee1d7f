"""Notification rules an ops_admin manages, and the log of every delivery (issue 12 item 2)."""

from django.core.validators import MinValueValidator
from django.db import models

from sessions_app import states as session_states
from sessions_app.models import Connection

TURN_FAILED, TURN_STALLED, STOP_UNCONFIRMED, CONNECTION_OFFLINE, RUN_FAILED, APPROVAL_WAITING, NEW_HOST = (
    "turn_failed", "turn_stalled", "stop_unconfirmed", "connection_offline", "run_failed", "approval_waiting",
    "key_new_host")
ANSWER_WAITING = "answer_waiting"
REVIEW_WAITING = "review_waiting"
TRIGGERS = [
    (TURN_FAILED, "turn failed with a wake error"),
    (TURN_STALLED, "turn stalled"),
    (STOP_UNCONFIRMED, "stop unconfirmed"),
    (CONNECTION_OFFLINE, "connection offline longer than N seconds"),
    (RUN_FAILED, "run failed or partially succeeded"),
    (APPROVAL_WAITING, "approval waiting longer than N seconds"),
    (ANSWER_WAITING, "turn waiting for an answer (requires action) longer than N seconds"),
    (REVIEW_WAITING, "issue waiting for review longer than N seconds"),
    (NEW_HOST, "daemon key used from a new host"),
]


class NotificationRule(models.Model):
    name = models.CharField(max_length=100, unique=True)
    enabled = models.BooleanField(default=True)
    trigger = models.CharField(max_length=32, choices=TRIGGERS)
    wake_error_kind = models.CharField(
        max_length=32, blank=True, default="", choices=[(k, k) for k in session_states.WAKE_ERROR_KINDS],
        help_text="turn failed: only this kind of wake error (blank: any)")
    older_than_s = models.PositiveIntegerField(
        default=0, help_text="connection offline, approval, answer or review waiting: only once it has been so this long "
                  "(seconds)")
    # Scope: blank matches everything.
    connection = models.ForeignKey(Connection, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    backend = models.CharField(max_length=16, blank=True, default="",
                               choices=session_states.choices(session_states.BACKENDS))
    workflow = models.CharField(max_length=200, blank=True, default="", help_text="runs: the workflow's name")
    # Where: any of these.
    email_to = models.TextField(blank=True, default="", help_text="addresses, comma- or line-separated")
    webhook_url = models.URLField(max_length=1000, blank=True, default="",
                                  help_text="a signed JSON POST (X-Chorus-Signature: sha256=HMAC of timestamp.body)")
    webhook_secret = models.CharField(max_length=200, blank=True, default="",
                                      help_text="the HMAC key the receiver verifies the signature with")
    quiet_period_s = models.PositiveIntegerField(
        default=3600, validators=[MinValueValidator(0)],
        help_text="one notification per object (session, connection or run) per rule per this many seconds")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def emails(self) -> list[str]:
        return [a.strip() for a in self.email_to.replace("\n", ",").split(",") if a.strip()]


class NotificationDelivery(models.Model):
    PENDING, SENT, FAILED, SUPPRESSED = "pending", "sent", "failed", "suppressed"
    STATES = [(s, s) for s in (PENDING, SENT, FAILED, SUPPRESSED)]
    EMAIL, WEBHOOK = "email", "webhook"

    rule = models.ForeignKey(NotificationRule, on_delete=models.PROTECT, related_name="deliveries")
    subject = models.CharField(max_length=200, help_text="what the quiet period counts: session:…, connection:…, run:…")
    about = models.CharField(max_length=200, help_text="the object it is about: turn:…, connection:…, run:…")
    channel = models.CharField(max_length=8, choices=[(EMAIL, EMAIL), (WEBHOOK, WEBHOOK)])
    target = models.CharField(max_length=1000)
    state = models.CharField(max_length=12, choices=STATES, default=PENDING)
    reason = models.TextField(blank=True, default="", help_text="why it failed or was suppressed")
    attempts = models.PositiveSmallIntegerField(default=0)
    payload = models.JSONField(default=dict)  # redacted
    event_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "notification deliveries"
        indexes = [models.Index(fields=["rule", "subject", "created_at"], name="delivery_quiet_idx")]

    def __str__(self):
        return f"{self.rule} → {self.channel} {self.about} ({self.state})"


class NotificationCursor(models.Model):
    """How far the scan has read the event log (one row)."""

    name = models.CharField(max_length=32, primary_key=True)
    last_event_id = models.BigIntegerField(default=0)
