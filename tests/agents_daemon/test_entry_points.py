"""How the daemon is started: the Django command, ``python -m agents.daemon``, and its independence
from the portal (the daemon side of agents/ imports nothing of Django or the portal apps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from agents.daemon import Daemon
from agents.daemon_config import build_config

ROOT = Path(__file__).resolve().parents[2]
DAEMON_MODULES = ["agents.daemon", "agents.daemon_config", "agents.process", "agents.proctree", "agents.runner",
                  "agents.spool", "agents.orphans", "agents.changes"]


def test_daemon_side_imports_nothing_of_the_portal():
    code = ("import sys, importlib\n"
            f"for name in {DAEMON_MODULES!r}: importlib.import_module(name)\n"
            "import agents.backends\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('django', 'chorus_site', 'sessions_app', 'executions', 'channels', 'ninja'))\n"
            "print(bad)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("argv, message", [
    (["--key", "k"], "portal URL is required"),
    (["--portal", "http://p", "--key", "k", "--max-concurrency", "0"], "--max-concurrency: expected a whole number"),
    (["--portal", "http://p", "--key", "k", "--backend", "nope"], "unknown backend 'nope'"),
])
def test_management_command_refuses_bad_settings(argv, message, monkeypatch):
    for name in ("CHORUS_PORTAL_URL", "CHORUS_DAEMON_KEY", "CHORUS_DAEMON_CONFIG", "CHORUS_MAX_CONCURRENCY",
                 "CHORUS_DAEMON_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CommandError, match=message):
        call_command("chorus_daemon", *argv)


def test_module_entry_point_exits_2_with_a_clear_message(tmp_path):
    result = subprocess.run([sys.executable, "-m", "agents.daemon", "--portal", "gopher://x", "--key", "k"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "chorus daemon: --portal: expected http(s)://host[:port], got 'gopher://x'" in result.stderr


def test_one_ctrl_c_under_a_supervisor_is_one_stop_request(tmp_path, monkeypatch):
    import agents.daemon as daemon_module

    config = build_config({"portal": "http://p", "key": "k", "cwds": [str(tmp_path)]}, {}, {})
    daemon = Daemon(config, install_signals=False)
    clock = [100.0]
    monkeypatch.setattr(daemon_module.time, "monotonic", lambda: clock[0])
    daemon.request_shutdown()            # SIGINT from the terminal
    clock[0] += 0.2
    daemon.request_shutdown()            # SIGTERM from the supervisor passing Ctrl-C on
    assert daemon.shutdown_signals == 1 and daemon.stopping
    clock[0] += 2
    daemon.request_shutdown()            # the operator insists: kill now
    assert daemon.shutdown_signals == 2
