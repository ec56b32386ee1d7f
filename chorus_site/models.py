"""Cross-cutting records: the event log, API tokens, idempotency and audit (SPEC §3.3)."""

from django.conf import settings
from django.db import models


class EventStream(models.Model):
    """Per-stream counters: the row lock taken when appending keeps seq gapless and ordered."""

    name = models.CharField(max_length=100, primary_key=True)
    last_seq = models.BigIntegerField(default=0)
    last_event_id = models.BigIntegerField(default=0)
    # Highest event id of this stream removed by retention: cursors below it are expired.
    purged_through_id = models.BigIntegerField(default=0)

    def __str__(self):
        return self.name


class Event(models.Model):
    """The one append-only log behind timelines, WebSockets and SSE. ``id`` is the cursor."""

    id = models.BigAutoField(primary_key=True)
    stream = models.CharField(max_length=100)
    seq = models.BigIntegerField()
    kind = models.CharField(max_length=64)
    data = models.JSONField(default=dict)
    actor = models.CharField(max_length=150, blank=True, default="")
    at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["stream", "seq"], name="event_stream_seq_unique")]
        indexes = [
            models.Index(fields=["stream", "id"], name="event_stream_id_idx"),
            models.Index(fields=["kind", "id"], name="event_kind_id_idx"),
        ]
        ordering = ["-id"]

    def __str__(self):
        return f"#{self.id} {self.stream} {self.kind}"

    def as_message(self) -> dict:
        return {
            "id": self.id,
            "stream": self.stream,
            "seq": self.seq,
            "kind": self.kind,
            "data": self.data,
            "actor": self.actor,
            "at": self.at.isoformat(),
        }


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)

    class Meta:
        verbose_name = "API token"

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"


class IdempotencyRecord(models.Model):
    STATE_PENDING = "pending"
    STATE_DONE = "done"

    key = models.CharField(max_length=255)
    # Whose key space: "user:<id>", "connection:<id>" (daemon reports) or "anonymous". Never null,
    # so the unique constraint holds for every caller (NULLs would all be distinct).
    scope = models.CharField(max_length=64)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.CASCADE)
    route = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    state = models.CharField(max_length=16, default=STATE_PENDING)
    response_status = models.PositiveSmallIntegerField(null=True)
    response_body = models.JSONField(null=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "route", "key"], name="idempotency_scope_route_key_unique")
        ]

    def __str__(self):
        return f"{self.route} {self.key}"


class AuditEntry(models.Model):
    CLIENT_CHOICES = [("admin", "admin"), ("api", "api"), ("system", "system")]

    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200, db_index=True)
    reason = models.TextField(blank=True, default="")
    client = models.CharField(max_length=8, choices=CLIENT_CHOICES)
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    outcome = models.CharField(max_length=200)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "audit entries"
        ordering = ["-id"]

    def __str__(self):
        return f"{self.actor} {self.action} {self.target}: {self.outcome}"


class PortalPresence(models.Model):
    """One row: the portal's daemon-facing side is up, and since when (chorus_site/presence.py).

    Kept by every portal process; read by the stale sweep, which never judges a daemon's silence
    while the portal itself could not hear it.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    alive_at = models.DateTimeField()
    up_since = models.DateTimeField()

    class Meta:
        verbose_name_plural = "portal presence"

    def __str__(self):
        return f"portal up since {self.up_since:%Y-%m-%d %H:%M:%S}, last seen {self.alive_at:%H:%M:%S}"
