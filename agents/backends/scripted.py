"""Backend ``scripted``: the bundled scripted agent (``agents/scripted_agent.py``, SPEC §5.1).

Its JSON lines are the normalised events themselves (``{"type": <kind>, ...data}``), plus three
kinds of its own — ``member``, ``comment``, ``artifact`` — which are the agent talking back to the
portal and are reported as tool events named ``chorus.member`` / ``chorus.comment`` /
``chorus.artifact`` (the agent posts them to the API itself when it has a task token).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from agents.protocol import EV_PROGRESS, EV_TOOL, EVENT_KINDS, AgentEvent

from .base import Backend, LaunchSpec, summarise

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the ``agents`` package
TALK_BACK = ("member", "comment", "artifact")


class ScriptedBackend(Backend):
    name = "scripted"
    binary = sys.executable

    def command(self, *, prompt: str, cwd: str, backend_session_id: str | None,
                env: Mapping[str, str]) -> LaunchSpec:
        argv = [self.executable, "-m", "agents.scripted_agent"]
        if backend_session_id:
            argv += ["--resume", backend_session_id]
        # The agent runs in the turn's cwd, so the package must be found wherever the project is.
        pythonpath = [PROJECT_ROOT] + [p for p in self.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return LaunchSpec(argv=argv, stdin=prompt, env={**env, "PYTHONPATH": os.pathsep.join(pythonpath)}, cwd=cwd)

    def takeover_command(self, backend_session_id: str | None, cwd: str) -> str | None:
        if not backend_session_id:
            return None
        # Pasted as printed it must run: this interpreter (the venv's, which has the project's
        # dependencies; a bare "python" may be another one or none) with the project on its path.
        return (f"PYTHONPATH={shlex.quote(PROJECT_ROOT)} {shlex.quote(sys.executable)} -m agents.scripted_agent "
                f"--resume {shlex.quote(backend_session_id)}")

    def parse_event(self, obj: dict) -> list[AgentEvent]:
        kind = obj.get("type")
        data = {k: v for k, v in obj.items() if k != "type"}
        if kind in TALK_BACK:
            return [AgentEvent(EV_TOOL, {"name": f"chorus.{kind}", "input": summarise(data)})]
        if kind == EV_PROGRESS and "message" not in data:
            data["message"] = ""
        if kind in EVENT_KINDS:
            return [AgentEvent(kind, data)]
        return []
