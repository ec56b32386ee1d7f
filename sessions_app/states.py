"""State machines of sessions_app (SPEC §3.1). Anything not listed is refused."""

# Turn status
PENDING, RUNNING, REQUIRES_ACTION, ENDED, INTERRUPTED, MERGED = (
    "pending", "running", "requires_action", "ended", "interrupted", "merged",
)
TURN_STATUSES = [PENDING, RUNNING, REQUIRES_ACTION, ENDED, INTERRUPTED, MERGED]
TURN_TRANSITIONS: dict[str, set[str]] = {
    PENDING: {RUNNING, INTERRUPTED, MERGED},
    RUNNING: {ENDED, INTERRUPTED, REQUIRES_ACTION},
    REQUIRES_ACTION: {RUNNING, ENDED, INTERRUPTED},
}
# The one way out of a terminal status, and only through services.turn_reopen_held: a turn the portal
# settled interrupted(offline) while its daemon was away, that the daemon still holds (SPEC §11: the
# daemon's snapshot is the truth about the processes it holds).  Never part of TURN_TRANSITIONS.
TURN_RECONCILE_TRANSITIONS: dict[str, set[str]] = {INTERRUPTED: {RUNNING}}
TURN_TERMINAL = {ENDED, INTERRUPTED, MERGED}
TURN_ACTIVE = {PENDING, RUNNING, REQUIRES_ACTION}

# Why a turn was interrupted.  ``offline`` is the server's verdict only; daemons may not report it.
REASON_USER, REASON_CRASH, REASON_SHUTDOWN, REASON_INVALID_PATH, REASON_OFFLINE, REASON_TIMEOUT = (
    "user", "crash", "shutdown", "invalid_path", "offline", "timeout",
)
INTERRUPTED_REASONS = [REASON_USER, REASON_CRASH, REASON_SHUTDOWN, REASON_INVALID_PATH, REASON_OFFLINE, REASON_TIMEOUT]
DAEMON_REPORTABLE_REASONS = set(INTERRUPTED_REASONS) - {REASON_OFFLINE}
# Only these reasons keep a wake error.
WAKE_ERROR_REASONS = {REASON_CRASH, REASON_INVALID_PATH, REASON_TIMEOUT}

# The verified stop (§4.1)
STOP_NONE, STOP_REQUESTED, STOP_SIGNALLED, STOP_ESCALATED, STOP_CONFIRMED, STOP_UNCONFIRMED = (
    "none", "requested", "signalled", "escalated", "confirmed", "unconfirmed",
)
STOP_STATES = [STOP_NONE, STOP_REQUESTED, STOP_SIGNALLED, STOP_ESCALATED, STOP_CONFIRMED, STOP_UNCONFIRMED]
STOP_TRANSITIONS: dict[str, set[str]] = {
    STOP_NONE: {STOP_REQUESTED, STOP_CONFIRMED},
    STOP_REQUESTED: {STOP_SIGNALLED, STOP_CONFIRMED, STOP_UNCONFIRMED},
    STOP_SIGNALLED: {STOP_ESCALATED, STOP_CONFIRMED, STOP_UNCONFIRMED},
    STOP_ESCALATED: {STOP_CONFIRMED, STOP_UNCONFIRMED},
    # Confirmed late (the daemon was frozen or cut off past the deadline), or asked again by an
    # operator (an interrupt reaches a process its daemon still holds, SPEC §4.1).
    STOP_UNCONFIRMED: {STOP_REQUESTED, STOP_CONFIRMED},
}

TRIGGERS = ["human_instruction", "task_assigned", "mentioned", "resume", "handoff", "system"]

WAKE_ERROR_KINDS = ["spawn_failed", "exited_nonzero", "signal", "invalid_path", "auth", "timeout", "protocol"]

# Session status
SESSION_ACTIVE, SESSION_ENDED = "active", "ended"
SESSION_TRANSITIONS: dict[str, set[str]] = {SESSION_ACTIVE: {SESSION_ENDED}, SESSION_ENDED: {SESSION_ACTIVE}}

# Connection status (derived from presence and heartbeat age)
CONN_ONLINE, CONN_OFFLINE, CONN_DRAINING = "online", "offline", "draining"
CONNECTION_TRANSITIONS: dict[str, set[str]] = {
    CONN_OFFLINE: {CONN_ONLINE, CONN_DRAINING},
    CONN_ONLINE: {CONN_OFFLINE, CONN_DRAINING},
    CONN_DRAINING: {CONN_ONLINE, CONN_OFFLINE},
}

BACKENDS = ["claude_code", "codex", "kiro", "dsh", "scripted"]

# Control commands for daemons
COMMAND_ACTIONS = ["start_turn", "interrupt", "resume", "probe"]
CMD_PENDING, CMD_DELIVERED, CMD_ACKED, CMD_DONE, CMD_EXPIRED = "pending", "delivered", "acked", "done", "expired"
COMMAND_TRANSITIONS: dict[str, set[str]] = {
    CMD_PENDING: {CMD_DELIVERED, CMD_ACKED, CMD_EXPIRED},
    CMD_DELIVERED: {CMD_PENDING, CMD_ACKED, CMD_EXPIRED},  # back to pending: redeliver after reconnect
    CMD_ACKED: {CMD_DONE, CMD_EXPIRED},
}


def choices(values):
    return [(value, value.replace("_", " ")) for value in values]
