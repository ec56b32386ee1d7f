"""State machines of executions (SPEC §3.2). Anything not listed is refused with invalid_transition."""


def _table(spec: dict[str, str]) -> dict[str, set[str]]:
    return {src: set(targets.split()) for src, targets in spec.items()}


RUN_STATES = ["planned", "running", "waiting", "paused", "cancelling", "cancelled", "succeeded",
              "partial_succeeded", "failed"]
RUN_TRANSITIONS = _table({
    "planned": "running cancelling cancelled failed",
    "running": "waiting paused cancelling succeeded partial_succeeded failed",
    "waiting": "running paused cancelling succeeded partial_succeeded failed",
    "paused": "running waiting cancelling",
    "cancelling": "cancelled",
})
RUN_TERMINAL = {"cancelled", "succeeded", "partial_succeeded", "failed"}

NODE_STATES = ["pending", "ready", "running", "waiting", "succeeded", "failed", "skipped", "cancelled"]
NODE_TRANSITIONS = _table({
    "pending": "ready skipped cancelled",
    "ready": "running waiting skipped failed cancelled",
    "running": "waiting succeeded failed cancelled",
    "waiting": "ready running succeeded failed cancelled",
})
NODE_TERMINAL = {"succeeded", "failed", "skipped", "cancelled"}

TASK_STATES = ["queued", "dispatched", "running", "waiting", "completed", "failed", "cancelled"]
TASK_TRANSITIONS = _table({
    "queued": "dispatched cancelled failed",
    "dispatched": "queued running waiting failed cancelled",
    "running": "queued waiting completed failed cancelled",
    "waiting": "queued running failed cancelled",
})
TASK_TERMINAL = {"completed", "failed", "cancelled"}

ATTEMPT_STATES = ["queued", "assigned", "preparing", "running", "waiting", "cancel_requested", "succeeded",
                  "failed", "cancelled"]
ATTEMPT_TERMINAL = {"succeeded", "failed", "cancelled"}
ATTEMPT_TRANSITIONS = _table({
    "queued": "assigned cancel_requested failed",
    "assigned": "preparing cancel_requested failed",
    "preparing": "running cancel_requested failed",
    "running": "waiting succeeded failed cancel_requested",
    "waiting": "running succeeded failed cancel_requested",
    "cancel_requested": "cancelled failed",
})

ISSUE_STATES = ["backlog", "todo", "in_progress", "in_review", "blocked", "done", "cancelled"]
ISSUE_TERMINAL = {"done", "cancelled"}
# "any → blocked → previous": blocked returns to whichever state it was entered from (kept on the
# issue as status_before_blocked); the table lists every state it may return to.
ISSUE_TRANSITIONS = _table({
    "backlog": "todo blocked cancelled",
    "todo": "in_progress blocked cancelled",
    "in_progress": "in_review blocked cancelled",
    "in_review": "done in_progress blocked cancelled",
    "blocked": "backlog todo in_progress in_review cancelled",
    "done": "in_progress",
})

APPROVAL_STATES = ["pending", "approved", "rejected", "cancelled"]
# cancelled: its run was cancelled (§4.7) before anyone decided; it can no longer be decided.
APPROVAL_TRANSITIONS = _table({"pending": "approved rejected cancelled"})

NODE_TYPES = ["agent", "approval", "subrun", "signal", "timer"]
RUN_MODES = ["direct", "adaptive", "declared", "subrun"]
COMPLETION_POLICIES = ["review", "automatic", "external"]
COMMENT_TYPES = ["comment", "progress", "result", "status", "system"]
ARTIFACT_KINDS = ["file", "diff", "test_log", "report", "link"]
OUTCOMES = ["succeeded", "waiting", "blocked", "failed"]
WAIT_REASONS = ["approval", "tool_result", "host_offline", "no_worker", "credentials", "capacity",
                "directory_busy", "signal", "timer", "dependency", "retry_backoff", "blocked"]
