"""Backend ``kiro``: Kiro CLI in headless mode.

    kiro-cli chat --no-interactive --trust-all-tools --output-format stream-json [--resume-id <id>] [ARGS]

The prompt goes to stdin (headless mode reads the whole piped stream as the instruction when no
prompt argument is given). Nobody is there to approve tools, hence ``--trust-all-tools``; narrow
it with CHORUS_KIRO_ARGS (e.g. ``--trust-tools read,grep``) where that matters.

What is known and what is not (see docs/daemon-backends.md):

* Headless Kiro printed only a human transcript until 2.19.2, which added
  ``--output-format stream-json`` so that callers can learn the session id; the event schema of
  that stream is not published in the docs this adapter was written from. The adapter therefore
  reads it tolerantly (``LooseJsonBackend``: session start with ``sessionId``, assistant text and
  deltas, tool calls, ``runError``-style errors, a closing result with usage) and treats non-JSON
  lines as transcript. Set ``CHORUS_KIRO_OUTPUT_FORMAT=text`` for releases without the flag: the
  plain transcript then becomes the final reply and no session id is learnt (resume and
  takeover stay unavailable, as SPEC §4.5 requires while the id is unknown).
* ``--resume-id`` resumes one saved session by id; it does not create a session for a new id.

No protocol stop in headless mode (ACP has ``session/cancel``, the chat command does not): SIGINT.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from .base import LaunchSpec
from .loose import LooseJsonBackend


class KiroBackend(LooseJsonBackend):
    name = "kiro"
    binary = "kiro-cli"

    @property
    def output_format(self) -> str | None:
        value = self.environ.get("CHORUS_KIRO_OUTPUT_FORMAT", "stream-json").strip()
        return None if value in ("", "text", "none") else value

    def command(self, *, prompt: str, cwd: str, backend_session_id: str | None,
                env: Mapping[str, str]) -> LaunchSpec:
        argv = [self.executable, "chat", "--no-interactive", "--trust-all-tools"]
        if self.output_format:
            argv += ["--output-format", self.output_format]
        if backend_session_id:
            argv += ["--resume-id", backend_session_id]
        return LaunchSpec(argv=argv + self.extra_args, stdin=prompt, env=dict(env), cwd=cwd)

    def takeover_command(self, backend_session_id: str | None, cwd: str) -> str | None:
        return f"kiro-cli chat --resume-id {shlex.quote(backend_session_id)}" if backend_session_id else None
