"""Backend ``dsh``: DeepSeek Harness (``@deepseek-ai/dsh``) one-shot runs.

    dsh exec --jsonl --ephemeral [CHORUS_DSH_ARGS]

A bare ``dsh exec`` reads the task from piped stdin. ``--jsonl`` prints a versioned stream: one
``init`` envelope, one ``v``-stamped line per event, one ``result`` line; the process exits 0
when the final turn completed and 1 otherwise. The stream's event names are read tolerantly
(``LooseJsonBackend``); its exact schema was not available when this adapter was written.

SPEC §3.1/§4.5: dsh keeps no session for us — every turn is a fresh run (``--ephemeral``
persists nothing), a resumed conversation is carried by the prompt the portal builds, no session
id is reported and there is no takeover command. Its turns have a time limit: 30 minutes, or
``CHORUS_DSH_TIMEOUT_MS`` (milliseconds) on the daemon's machine; the daemon stops a turn that
runs longer and reports it ``interrupted(timeout)``. No protocol stop: SIGINT.
"""

from __future__ import annotations

from collections.abc import Mapping

from agents.protocol import EV_PROGRESS, EV_SESSION, AgentEvent

from .base import LaunchSpec
from .loose import LooseJsonBackend

DEFAULT_TIMEOUT_S = 30 * 60
TIMEOUT_ENV = "CHORUS_DSH_TIMEOUT_MS"


class DshBackend(LooseJsonBackend):
    name = "dsh"
    binary = "dsh"
    keeps_session = False

    @property
    def default_timeout_s(self) -> float:
        raw = self.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return float(DEFAULT_TIMEOUT_S)
        try:
            ms = int(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a whole number of milliseconds, got {raw!r}") from None
        if ms <= 0:
            raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
        return ms / 1000

    def command(self, *, prompt: str, cwd: str, backend_session_id: str | None,
                env: Mapping[str, str]) -> LaunchSpec:
        # backend_session_id is ignored on purpose: dsh keeps no session (see the module doc).
        return LaunchSpec(argv=[self.executable, "exec", "--jsonl", "--ephemeral", *self.extra_args],
                          stdin=prompt, env=dict(env), cwd=cwd)

    def takeover_command(self, backend_session_id: str | None, cwd: str) -> str | None:
        return None

    def parse_event(self, obj: dict) -> list[AgentEvent]:
        # An ephemeral run's id cannot be resumed: show it as progress, never as the session id.
        return [AgentEvent(EV_PROGRESS, {"message": "run id", "run_id": e.data.get("id")}) if e.kind == EV_SESSION
                else e for e in super().parse_event(obj)]
