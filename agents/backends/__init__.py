"""Backend adapters (SPEC §5): one per agent CLI the daemon can run.

    from agents.backends import get_backend
    backend = get_backend("claude_code")
    spec = backend.command(prompt=..., cwd=..., backend_session_id=None, env={...})

See ``base.Backend`` for the interface and docs/daemon-backends.md for each CLI.
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import Backend, LaunchSpec, summarise_events, usage_total
from .claude_code import ClaudeCodeBackend
from .codex import CodexBackend
from .dsh import DshBackend
from .kiro import KiroBackend
from .scripted import ScriptedBackend

BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls for cls in (ClaudeCodeBackend, CodexBackend, KiroBackend, DshBackend, ScriptedBackend)
}
BACKEND_NAMES = tuple(BACKENDS)


def get_backend(name: str, environ: Mapping[str, str] | None = None) -> Backend:
    """The adapter for a connection's backend name; KeyError for a name no adapter has.

    ``environ`` holds machine-level settings (default: this process's environment).
    """
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}") from None
    return cls(environ)


__all__ = ["BACKENDS", "BACKEND_NAMES", "Backend", "LaunchSpec", "get_backend", "summarise_events", "usage_total"]
