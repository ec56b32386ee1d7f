"""The daemon masks secrets before a report is spooled (issue 8 item 10): nothing raw on disk."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from agents.runner import TurnRequest, TurnRunner
from agents.spool import ReportSender, Spool
from agents.daemon import SpoolReporter

from .helpers import kill_quietly

PEM_LINES = ["MIIEowIBAAKCAQEAw9wR1dCh0a4xqv2mQjk0d0d6b0B1n4bx9y0e5oL4mXkRj7Qa",
             "Kz3b8vPq9rT2yW5uN1cF7gH4jL6mS0dA3eR8tY2uI5oP1aZ4xC7vB9nM3kJ6hG0f"]
SECRETS = {
    "stdout": "ghp_DaemonStdoutCanary0123456789abcdefAB",
    "stderr": "sk-ant-api03-DaemonStderrCanary0123456789abcdefghijklmnop",
    "json-escaped": "xoxb-123456789012-1234567890123-DaemonJsonCanary012345",
    "cmdline": "glpat-DaemonCmdlineCanary0123",
    "requires-action": "sk_live_DaemonRequiresActionCanary0123456789",
    "pem-1": PEM_LINES[0][:40],
    "pem-2": PEM_LINES[1][:40],
}


@pytest.fixture
def workdir(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    (root / "out.txt").write_text(
        f"export GITHUB_TOKEN={SECRETS['stdout']}\n"
        + json.dumps({"type": "text", "text": f"env dump\nSLACK={SECRETS['json-escaped']}\nnul \x00 here, half \ud800 there"}) + "\n"
        + "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(PEM_LINES) + "\n-----END RSA PRIVATE KEY-----\n")
    (root / "err.txt").write_text(f"Traceback: x-api-key {SECRETS['stderr']} refused\n")
    (root / "ra.txt").write_text(f"Deploy with STRIPE_KEY={SECRETS['requires-action']}?")
    (root / "arg.txt").write_text(f"--token={SECRETS['cmdline']}")
    return root


async def run(workdir, tmp_path, prompt):
    spool = Spool(str(tmp_path / "spool"))
    sender = ReportSender(spool, post=_unreachable)  # the portal never answers: every report stays spooled
    request = TurnRequest(turn="turn-1", session="session-1", cwd=str(workdir), prompt=prompt, timeout_s=None,
                          env={"CHORUS_API_URL": "http://portal.invalid/api/v1"})
    runner = TurnRunner(request, allowed_cwds=(str(workdir.resolve()),), default_backend="scripted",
                        sigint_timeout_s=2.0, reporter=SpoolReporter(sender),
                        environ={**os.environ, "CHORUS_SCRIPTED_HOME": str(tmp_path / "home")})
    await asyncio.wait_for(runner.run(), 60)
    await sender.close()  # every submitted report is on disk
    texts = [open(os.path.join(root, name), encoding="utf-8", errors="replace").read()
             for root, _dirs, files in os.walk(tmp_path / "spool") for name in files if name.endswith(".json")]
    spool.close()
    return texts


async def _unreachable(path, body):
    await asyncio.sleep(3600)


async def test_spooled_reports_hold_no_secret(workdir, tmp_path):
    texts = await run(workdir, tmp_path, "@cat out.txt\n@stderr-file err.txt\n@background 30 {file:arg.txt}\n"
                                         "@require-approval {file:ra.txt}")
    try:
        on_disk = "\n".join(texts)
        assert '"status":"requires_action"' in on_disk.replace(" ", "") and "background_processes" in on_disk
        assert [cid for cid, secret in SECRETS.items() if secret in on_disk] == []
        assert "\\u0000" not in on_disk and "\x00" not in on_disk and "\\ud800" not in on_disk
        assert "\\ufffd here, half \\ufffd there" in on_disk  # replaced, documented (U+FFFD)
    finally:
        for text in texts:
            for proc in json.loads(text)["body"].get("background_processes") or []:
                kill_quietly(proc["pid"])


async def test_a_failing_exit_keeps_no_secret_in_its_wake_error(workdir, tmp_path):
    texts = await run(workdir, tmp_path, "@cat out.txt\n@stderr-file err.txt\n@exit 3")
    on_disk = "\n".join(texts)
    assert "exited_nonzero" in on_disk and "Traceback: x-api-key" in on_disk
    assert [cid for cid, secret in SECRETS.items() if secret in on_disk] == []
