"""Fixtures for the real-CLI end-to-end tests (issue 10): the pinned Claude Code / Codex binaries
from ``make agent-clis``, the model stand-in, and a bridge (portal, Celery with beat, daemon) whose
daemon runs the real CLI against the stand-in.

The binaries are looked up in $CHORUS_AGENT_CLI_DIR (``make test`` sets it) or ``.agents-cli/``.
Missing or at another version than the Makefile pins, the tests FAIL saying how to install them:
nothing is skipped silently.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from chorus_site.tokens import token_create
from sessions_app import services
from sessions_app.models import Turn
from tests.e2e.conftest import ROOT, Api, Daemon, kill_group, wait_online, wait_until
from tests.model_standin import ModelStandin

SIGINT_TIMEOUT_S = 3
BINARIES = {"claude_code": ("claude", "@anthropic-ai/claude-code"), "codex": ("codex", "@openai/codex")}
API_KEY = "standin-key-0000"


def pinned_versions() -> dict[str, str]:
    """package -> version, from the Makefile's AGENT_CLIS line (the one place they are pinned)."""
    text = os.environ.get("CHORUS_AGENT_CLIS")
    if not text:
        match = re.search(r"^AGENT_CLIS\s*:?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
        text = match.group(1) if match else ""
    return dict(item.rsplit("@", 1) for item in text.split())


def cli_binary(backend: str) -> str:
    name, package = BINARIES[backend]
    base = Path(os.environ.get("CHORUS_AGENT_CLI_DIR") or ROOT / ".agents-cli")
    path = base / "node_modules" / ".bin" / name
    want = pinned_versions().get(package)
    if not path.exists():
        pytest.fail(f"{package}@{want} is not installed at {path}: run `make agent-clis` "
                    f"(make test and .ci/run do) — the real-CLI tests need it")
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60).stdout
    if want and want not in out:
        pytest.fail(f"{path} is {out.strip()!r}, the Makefile pins {package}@{want}: run `make agent-clis`")
    return str(path)


def group_processes(pgid: int) -> list[str]:
    """Live processes (not zombies) of a process group: 'pid cmdline'."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{entry} {cmdline}")
        except (OSError, IndexError, ValueError):
            continue
    return found


def codex_config(codex_home: Path, base_url: str) -> None:
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(f'''model = "gpt-5.5"
model_provider = "standin"

[model_providers.standin]
name = "standin"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "STANDIN_API_KEY"
request_max_retries = 1
stream_max_retries = 1
''')


@pytest.fixture
def standin():
    server = ModelStandin().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def real_cli(portal_server, celery_beat_worker, operator, workspace, tmp_path, standin):
    """``real_cli(backend, **options)``: a bridge whose daemon runs that real CLI against the
    stand-in (``real_bridge``'s options), stopped at the end of the test. The test modules'
    ``claude`` / ``codex`` fixtures are one call of it."""
    started = []

    def make(backend: str, **options):
        bridge = real_bridge(backend, portal_server, operator, workspace, tmp_path, standin, **options)
        started.append(bridge)
        return bridge

    try:
        yield make
    finally:
        for bridge in started:
            stop_bridge(bridge)


CLAUDE_ARGS = "--permission-mode acceptEdits --allowedTools Bash"


def real_bridge(backend, portal_server, operator, workspace, tmp_path, standin, *, claude_args: str = CLAUDE_ARGS,
                binary: str | None = None, env: dict[str, str] | None = None):
    """Register a connection with ``backend`` and start its daemon with the real CLI (or ``binary``);
    ``env`` is laid over the daemon's environment. The daemon user's home is ``bridge["home"]``
    (Claude reads ``~/.claude/settings.json`` there at each run)."""
    binary = binary or cli_binary(backend)
    connection, key = services.connection_register(name=f"e2e-{backend}", backend=backend, cwds=[str(workspace)],
                                                   sigint_timeout_s=SIGINT_TIMEOUT_S)
    daemon = Daemon(portal_server, key, str(workspace), tmp_path, sigint_timeout_s=SIGINT_TIMEOUT_S)
    daemon.args[daemon.args.index("--backend") + 1] = backend
    home = tmp_path / "home"
    home.mkdir()
    (home / ".claude").mkdir()
    extra_env, env = env, {"HOME": str(home), "CHORUS_CLAUDE_CODE_BIN": binary, "CHORUS_CODEX_BIN": binary,
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CODE_MAX_RETRIES": "2"}
    if backend == "claude_code":
        env.update(ANTHROPIC_BASE_URL=standin.url, ANTHROPIC_API_KEY=API_KEY,
                   CHORUS_CLAUDE_CODE_ARGS=claude_args)
    else:
        codex_config(home / ".codex", standin.url)
        env.update(CODEX_HOME=str(home / ".codex"), STANDIN_API_KEY=API_KEY)
    for name in ("ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY", "OPENAI_BASE_URL", "CLAUDE_CONFIG_DIR"):
        daemon.env.pop(name, None)
    daemon.env.update(env)
    daemon.env.update(extra_env or {})
    daemon.start()
    _token, raw = token_create(user=operator, name="e2e")
    api = Api(portal_server, raw)
    wait_online(connection, timeout=60)
    return {"connection": connection, "daemon": daemon, "api": api, "workspace": workspace, "home": home,
            "standin": standin, "binary": binary, "portal": portal_server}


def stop_bridge(bridge) -> None:
    bridge["daemon"].stop()
    for turn in Turn.objects.exclude(pid=None):
        kill_group(turn.pid)


def start(bridge, prompt: str, **extra) -> Turn:
    status, body = bridge["api"].call("POST", "/sessions", {
        "connection": str(bridge["connection"].pk), "cwd": str(bridge["workspace"]), "prompt": prompt, **extra})
    assert status == 201, body
    return Turn.objects.get(pk=body["turn"])


def resume(bridge, session_id, context: str) -> Turn:
    status, body = bridge["api"].call("POST", f"/sessions/{session_id}/resume", {"context": context})
    assert status == 200, body
    return Turn.objects.get(pk=body["turn"])


def message(bridge, session_id, prompt: str) -> Turn:
    status, body = bridge["api"].call("POST", f"/sessions/{session_id}/messages", {"prompt": prompt})
    assert status == 200, body
    return Turn.objects.get(pk=body["turn"])


def wait_status(turn, statuses, timeout=60, bridge=None):
    statuses = {statuses} if isinstance(statuses, str) else set(statuses)

    def settled():
        current = Turn.objects.get(pk=turn.pk)
        return current.status in statuses and current

    try:
        return wait_until(settled, timeout=timeout, message=f"turn to reach {statuses}")
    except AssertionError:
        current = Turn.objects.get(pk=turn.pk)
        log = bridge["daemon"].log()[-3000:] if bridge else ""
        raise AssertionError(f"turn is {current.status} ({current.wake_error}); daemon log:\n{log}") from None


def api_retrying(bridge, turn) -> dict | None:
    """The turn's live "retrying" state as GET /turns/{id} says it."""
    status, body = bridge["api"].call("GET", f"/turns/{turn.pk}")
    assert status == 200, body
    return body["retrying"]


def progress_messages(turn) -> list[str]:
    from chorus_site.models import Event

    messages = []
    for event in Event.objects.filter(stream=turn.stream, kind="turn.output").order_by("id"):
        data = event.data or {}
        if data.get("type") == "progress":
            messages.append(str((data.get("data") or {}).get("message") or ""))
    return messages
