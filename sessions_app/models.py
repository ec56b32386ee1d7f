"""Connections, sessions, turns, transcripts and control commands (SPEC §3.1).

Status fields are written only by the services in ``services.py``.
"""

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from chorus_site.ids import short_id, uuid7
from chorus_site.permissions import ACTION_PERMISSIONS

from . import states


def _perms(model: str):
    return ACTION_PERMISSIONS["sessions_app"].get(model, [])


class Connection(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    name = models.CharField(max_length=100, unique=True)
    host = models.CharField(max_length=255, blank=True, default="")
    backend = models.CharField(max_length=16, choices=states.choices(states.BACKENDS))
    cwds = models.JSONField(default=list, help_text="Allowed working-directory roots")
    key_prefix = models.CharField(max_length=16, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, editable=False)
    max_concurrency = models.PositiveIntegerField(default=4)
    sigint_timeout_s = models.PositiveIntegerField(default=10)
    auto_resume_crashed = models.BooleanField(default=False)
    # A running turn silent this long is flagged stalled (sessions_app/stalls.py); blank: the
    # backend's threshold (BackendSetting), else settings.CHORUS_STALL_THRESHOLD_S.
    stall_threshold_s = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Seconds without output before a running turn is flagged stalled; "
                                         "blank: the backend's setting, else the site default")
    status = models.CharField(
        max_length=16, choices=states.choices([states.CONN_ONLINE, states.CONN_OFFLINE, states.CONN_DRAINING]),
        default=states.CONN_OFFLINE, db_index=True,
    )
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    daemon_version = models.CharField(max_length=32, blank=True, default="")
    capabilities = models.JSONField(default=dict, blank=True)
    last_snapshot = models.JSONField(default=dict, blank=True)
    # The daemon socket that currently speaks for this connection (its channel name): a second
    # socket with the same key replaces it, and only the current one's close takes presence down.
    daemon_socket = models.CharField(max_length=255, blank=True, default="", editable=False)
    # The daemon's latest process sample of each running turn (its heartbeat: waiting on a child or
    # silent, CPU, the children's command lines, redacted), kept as evidence for stall detection.
    turn_activity = models.JSONField(default=dict, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        permissions = _perms("connection")

    def __str__(self):
        return self.name


class Session(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    idea_key = models.CharField(max_length=255)
    title = models.CharField(max_length=255, blank=True, default="")
    connection = models.ForeignKey(Connection, on_delete=models.PROTECT, related_name="sessions")
    cwd = models.CharField(max_length=1024)
    backend = models.CharField(max_length=16, choices=states.choices(states.BACKENDS))
    backend_session_id = models.CharField(max_length=255, null=True, blank=True)
    provider = models.CharField(max_length=64, blank=True, default="")
    model = models.CharField(max_length=128, blank=True, default="")
    status = models.CharField(
        max_length=8, choices=states.choices([states.SESSION_ACTIVE, states.SESSION_ENDED]),
        default=states.SESSION_ACTIVE,
    )
    last_turn_at = models.DateTimeField(null=True, blank=True)
    tokens_input = models.BigIntegerField(default=0)
    tokens_output = models.BigIntegerField(default=0)
    tokens_cache_read = models.BigIntegerField(default=0)
    tokens_cache_write = models.BigIntegerField(default=0)
    handoff_from = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="handoff_to"
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["idea_key"], condition=Q(status="active"), name="session_one_active_per_idea_key"
            )
        ]
        indexes = [
            models.Index(fields=["status", "id"], name="session_status_id_idx"),
            models.Index(fields=["connection", "id"], name="session_connection_id_idx"),
            models.Index(fields=["backend", "id"], name="session_backend_id_idx"),
            models.Index(fields=["cwd"], name="session_cwd_idx"),
            models.Index(fields=["idea_key"], name="session_idea_key_idx"),
        ]
        ordering = ["-id"]
        permissions = _perms("session")

    def __str__(self):
        return self.title or self.idea_key

    @property
    def stream(self) -> str:
        return f"session:{self.id}"


class Turn(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="turns")
    seq = models.PositiveIntegerField()
    trigger = models.CharField(max_length=24, choices=states.choices(states.TRIGGERS))
    prompt = models.TextField(blank=True, default="")
    status = models.CharField(
        max_length=16, choices=states.choices(states.TURN_STATUSES), default=states.PENDING
    )
    interrupted_reason = models.CharField(
        max_length=16, choices=states.choices(states.INTERRUPTED_REASONS), blank=True, default=""
    )
    stop_state = models.CharField(
        max_length=12, choices=states.choices(states.STOP_STATES), default=states.STOP_NONE
    )
    stop_deadline_at = models.DateTimeField(null=True, blank=True)
    # {summary, kind, source, details, exit_code, signal}; details are redacted before storage.
    wake_error = models.JSONField(null=True, blank=True)
    interrupt_evidence = models.JSONField(null=True, blank=True)
    usage = models.JSONField(default=dict, blank=True)
    # Set by executions when the turn executes an attempt (kept as a plain id: sessions_app never
    # imports executions).
    attempt_id = models.UUIDField(null=True, blank=True, db_index=True)
    merged_into = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # The connection that runs (or ran) this turn, set when it is dispatched.  Commands for the turn
    # (interrupt, probe) go there and only its daemon may report on the turn, even after the
    # session moved to another connection (§3.1).  Null until dispatched.
    connection = models.ForeignKey(Connection, null=True, blank=True, on_delete=models.PROTECT, related_name="turns")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    final_reply = models.TextField(blank=True, default="")
    changes = models.JSONField(default=dict, blank=True)
    background_processes = models.JSONField(default=list, blank=True)
    requires_action = models.JSONField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    # A flag on a running turn, not a status (sessions_app/stalls.py): set when nothing came from it
    # for its connection's threshold, with the evidence; cleared when output resumes or it leaves running.
    stalled_at = models.DateTimeField(null=True, blank=True)
    stall_evidence = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["session", "seq"], name="turn_session_seq_unique")]
        indexes = [
            models.Index(fields=["stalled_at"], name="turn_stalled_idx", condition=Q(stalled_at__isnull=False)),
            models.Index(fields=["status", "id"], name="turn_status_id_idx"),
            models.Index(fields=["interrupted_reason", "id"], name="turn_reason_id_idx"),
            models.Index(fields=["trigger", "id"], name="turn_trigger_id_idx"),
        ]
        ordering = ["-id"]
        permissions = _perms("turn")

    def __str__(self):
        # The session's name when it is loaded (no query of its own: listed on large changelists).
        if Turn.session.is_cached(self):
            return f"turn {self.seq} of {self.session}"
        return f"turn {self.seq} of session {short_id(self.session_id)}"

    @property
    def stream(self) -> str:
        return f"session:{self.session_id}"

    @property
    def stalled(self) -> str:
        """``stalled`` or ``not_stalled``, as the turn.stalled / turn.unstalled events say (live badges)."""
        return "stalled" if self.status == states.RUNNING and self.stalled_at is not None else "not_stalled"

    @property
    def status_label(self) -> str:
        if self.status == states.INTERRUPTED and self.interrupted_reason:
            return f"interrupted ({self.interrupted_reason})"
        return self.status.replace("_", " ")


class BackendSetting(models.Model):
    """Per-backend defaults an ops_admin edits in the admin (a connection's own value wins)."""

    backend = models.CharField(max_length=16, choices=states.choices(states.BACKENDS), unique=True)
    stall_threshold_s = models.PositiveIntegerField(
        validators=[MinValueValidator(1)],
        help_text="Seconds without output before a running turn of this backend is flagged stalled")

    class Meta:
        ordering = ["backend"]

    def __str__(self):
        return f"{self.backend}: stalled after {self.stall_threshold_s} s"


class TranscriptMessage(models.Model):
    ROLE_CHOICES = [("user", "user"), ("assistant", "assistant")]
    WINDOW = 200

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="transcript")
    turn = models.ForeignKey(Turn, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    role = models.CharField(max_length=12, choices=ROLE_CHOICES)
    text = models.TextField()
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["session", "id"], name="transcript_session_id_idx")]
        ordering = ["id"]

    def __str__(self):
        return f"{self.role}: {self.text[:40]}"


class ControlCommand(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    connection = models.ForeignKey(Connection, on_delete=models.CASCADE, related_name="commands")
    action = models.CharField(max_length=16, choices=states.choices(states.COMMAND_ACTIONS))
    turn = models.ForeignKey(Turn, null=True, blank=True, on_delete=models.CASCADE, related_name="commands")
    payload = models.JSONField(default=dict, blank=True)
    state = models.CharField(
        max_length=12,
        choices=states.choices([states.CMD_PENDING, states.CMD_DELIVERED, states.CMD_ACKED, states.CMD_DONE,
                                states.CMD_EXPIRED]),
        default=states.CMD_PENDING,
    )
    result = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    acked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["connection", "state", "id"], name="command_conn_state_idx")]
        ordering = ["-id"]

    def __str__(self):
        where = self.connection.name if ControlCommand.connection.is_cached(self) else short_id(self.connection_id)
        return f"{self.action} → {where} ({self.state})"
