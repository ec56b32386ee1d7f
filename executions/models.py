"""Issues, comments, artifacts, workflows, runs, nodes, tasks, attempts, approvals (SPEC §3.2)."""

from django.conf import settings
from django.db import models

from chorus_site.ids import short_id, uuid7
from chorus_site.permissions import ACTION_PERMISSIONS
from sessions_app.models import Connection, Session, Turn
from sessions_app.states import BACKENDS, choices

from . import states


def _perms(model: str):
    return ACTION_PERMISSIONS["executions"].get(model, [])


def _state_field(values, default, **kwargs):
    return models.CharField(max_length=20, choices=choices(values), default=default, **kwargs)


class Issue(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    title = models.CharField(max_length=255)
    body = models.TextField(blank=True, default="")
    acceptance_criteria = models.TextField(blank=True, default="")
    completion_policy = models.CharField(max_length=12, choices=choices(states.COMPLETION_POLICIES), default="review")
    status = _state_field(states.ISSUE_STATES, "backlog")
    status_before_blocked = models.CharField(max_length=20, blank=True, default="")
    assignee = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="assigned_issues")
    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["status", "id"], name="issue_status_id_idx")]
        ordering = ["-id"]
        permissions = _perms("issue")

    def __str__(self):
        return self.title


class WorkflowDefinition(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class WorkflowRevision(models.Model):
    """Immutable once created: a new definition change is a new revision."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    workflow = models.ForeignKey(WorkflowDefinition, on_delete=models.CASCADE, related_name="revisions")
    number = models.PositiveIntegerField()
    spec = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["workflow", "number"], name="workflow_revision_unique")]
        ordering = ["workflow", "-number"]

    def __str__(self):
        return f"{self.workflow.name} r{self.number}"


class Run(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    issue = models.ForeignKey(Issue, on_delete=models.PROTECT, related_name="runs")
    mode = models.CharField(max_length=10, choices=choices(states.RUN_MODES))
    state = _state_field(states.RUN_STATES, "planned")
    workflow_revision = models.ForeignKey(WorkflowRevision, null=True, blank=True, on_delete=models.PROTECT)
    parent_run = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="child_runs")
    parent_node = models.ForeignKey("RunNode", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    rerun_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="reruns")
    trigger = models.CharField(max_length=32, blank=True, default="manual")
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    input = models.JSONField(default=dict, blank=True)
    output = models.JSONField(default=dict, blank=True)
    target = models.JSONField(default=dict, blank=True)
    policy = models.JSONField(default=dict, blank=True)
    wait_reason = models.CharField(max_length=20, choices=choices(states.WAIT_REASONS), blank=True, default="")
    wait_detail = models.JSONField(default=dict, blank=True)
    failure_code = models.CharField(max_length=64, blank=True, default="")
    failure_message = models.TextField(blank=True, default="")
    version = models.PositiveIntegerField(default=1)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["state", "id"], name="run_state_id_idx"),
            models.Index(fields=["mode", "id"], name="run_mode_id_idx"),
            models.Index(fields=["issue", "id"], name="run_issue_id_idx"),
            models.Index(fields=["created_at"], name="run_created_at_idx"),
        ]
        ordering = ["-id"]
        permissions = _perms("run")

    def __str__(self):
        # Related names only when loaded (no query of its own: listed on large changelists).
        of = f" of {self.issue}" if Run.issue.is_cached(self) else ""
        return f"{self.mode} run {short_id(self.id)}{of}"

    @property
    def stream(self) -> str:
        return f"run:{self.id}"


class RunNode(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="nodes")
    key = models.CharField(max_length=100)
    type = models.CharField(max_length=10, choices=choices(states.NODE_TYPES), default="agent")
    state = _state_field(states.NODE_STATES, "pending")
    iteration = models.PositiveIntegerField(default=0)
    depends_on = models.JSONField(default=list, blank=True)
    config = models.JSONField(default=dict, blank=True)
    wait_reason = models.CharField(max_length=20, choices=choices(states.WAIT_REASONS), blank=True, default="")
    wait_detail = models.JSONField(default=dict, blank=True)
    failure_code = models.CharField(max_length=64, blank=True, default="")
    failure_message = models.TextField(blank=True, default="")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key", "iteration"], name="run_node_key_unique")]
        ordering = ["id"]

    def __str__(self):
        return f"{self.key} ({self.state})"


class AgentTask(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    node = models.ForeignKey(RunNode, on_delete=models.CASCADE, related_name="tasks")
    ordinal = models.PositiveIntegerField(default=1)
    status = _state_field(states.TASK_STATES, "queued")
    retry_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="retries")
    leader = models.BooleanField(default=False)
    session = models.ForeignKey(Session, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    current_attempt = models.ForeignKey("Attempt", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    wait_reason = models.CharField(max_length=20, choices=choices(states.WAIT_REASONS), blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "ordinal"], name="agent_task_ordinal_unique")]
        ordering = ["id"]
        verbose_name = "agent task"
        permissions = _perms("agenttask")

    def __str__(self):
        of = f" of {self.node.key}" if AgentTask.node.is_cached(self) else ""  # no join of its own
        return f"task {self.ordinal} {short_id(self.pk)}{of}"


class Attempt(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    task = models.ForeignKey(AgentTask, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    state = _state_field(states.ATTEMPT_STATES, "queued")
    connection = models.ForeignKey(Connection, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    session = models.ForeignKey(Session, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    turn = models.ForeignKey(Turn, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    backend = models.CharField(max_length=16, choices=choices(BACKENDS), blank=True, default="")
    provider_session_id = models.CharField(max_length=255, blank=True, default="")
    cwd = models.CharField(max_length=1024, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # {intent: succeeded|waiting|blocked|failed, summary, waiting_on}
    outcome = models.JSONField(null=True, blank=True)
    failure_code = models.CharField(max_length=64, blank=True, default="")
    failure_message = models.TextField(blank=True, default="")
    usage = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "number"], name="attempt_number_unique")]
        indexes = [
            models.Index(fields=["state", "id"], name="attempt_state_id_idx"),
            models.Index(fields=["connection", "id"], name="attempt_connection_id_idx"),
        ]
        ordering = ["-id"]

    def __str__(self):
        of = self.task if Attempt.task.is_cached(self) else f"task {short_id(self.task_id)}"
        return f"attempt {self.number} of {of}"


class Approval(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    node = models.ForeignKey(RunNode, null=True, blank=True, on_delete=models.CASCADE, related_name="approvals")
    turn = models.ForeignKey(Turn, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    approver_user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                      related_name="+")
    approver_group = models.ForeignKey("auth.Group", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    prompt = models.TextField(blank=True, default="")
    status = _state_field(states.APPROVAL_STATES, "pending")
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    decided_at = models.DateTimeField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")
    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        permissions = _perms("approval")

    def __str__(self):
        return f"approval {short_id(self.id)} ({self.status})"


class Comment(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    issue = models.ForeignKey(Issue, on_delete=models.CASCADE, related_name="comments")
    type = models.CharField(max_length=10, choices=choices(states.COMMENT_TYPES), default="comment")
    author = models.CharField(max_length=150)
    body = models.TextField()
    source_task = models.ForeignKey(AgentTask, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    source_attempt = models.ForeignKey(Attempt, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["issue", "id"], name="comment_issue_id_idx")]
        ordering = ["id"]

    def __str__(self):
        return f"{self.type} by {self.author}"


class Artifact(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    issue = models.ForeignKey(Issue, on_delete=models.CASCADE, related_name="artifacts")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="artifacts")
    attempt = models.ForeignKey(Attempt, null=True, blank=True, on_delete=models.SET_NULL, related_name="artifacts")
    kind = models.CharField(max_length=10, choices=choices(states.ARTIFACT_KINDS))
    name = models.CharField(max_length=255)
    content = models.TextField(blank=True, default="")
    sha256 = models.CharField(max_length=64)
    size = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["issue", "id"], name="artifact_issue_id_idx")]
        ordering = ["-id"]

    def __str__(self):
        return self.name
