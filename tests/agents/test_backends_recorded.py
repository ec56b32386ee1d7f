"""The adapters on output recorded from the real CLIs at the pinned versions (Claude Code 2.1.328,
Codex 0.169.0) against tests/model_standin.py — fast checks of what tests/e2e/test_real_cli_*.py
prove end to end (issue 10)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from agents.backends import get_backend, summarise_events
from agents.backends.claude_code import ClaudeCodeBackend
from agents.backends.codex import CodexBackend
from agents.backends.base import LaunchSpec
from agents.protocol import EV_ERROR, EV_PROGRESS, EV_TEXT
from agents.runner import TurnRequest, TurnRunner
from tests.agents_daemon.helpers import ListReporter

FIXTURES = Path(__file__).parent / "fixtures"


def parse(name: str, fixture: str):
    events = get_backend(name, {}).parse_output((FIXTURES / fixture).read_bytes())
    return events, summarise_events(events)


def test_claude_retries_show_as_progress_and_the_error_result_is_fatal_with_its_cause():
    events, summary = parse("claude_code", "claude_code_2.1.328_overloaded.jsonl")
    progress = [e.data["message"] for e in events if e.kind == EV_PROGRESS]
    assert "retrying: overloaded (attempt 1 of 2, next in 1 s)" in progress
    retry = next(e.data["retry"] for e in events if e.kind == EV_PROGRESS and "retry" in e.data)
    assert (retry["attempt"], retry["max_retries"], retry["error_status"]) == (1, 2, 529)
    assert not [e for e in events if e.kind == EV_TEXT]  # the CLI's error text is not a reply
    assert summary["final_reply"] is None
    fatal = [e.data for e in events if e.kind == EV_ERROR and e.data.get("fatal")]
    assert len(fatal) == 1 and fatal[0]["cause"].startswith("the model is overloaded (529)")
    kind, text = get_backend("claude_code", {}).failure(events, 1, "")
    assert kind == "exited_nonzero" and "overloaded (529)" in text


def test_codex_refused_key_is_fatal_auth_and_reconnects_are_retries():
    events, summary = parse("codex", "codex_0.169.0_unauthorized.jsonl")
    assert summary["backend_session_id"]
    retries = [e.data for e in events if e.kind == EV_PROGRESS and "retry" in e.data]
    assert [r["message"] for r in retries] == ["retrying: authentication failed (attempt 1 of 1)"]
    assert retries[0]["retry"]["error_status"] == 401 and "Reconnecting... 1/1" in retries[0]["detail"]
    kind, text = get_backend("codex", {}).failure(events, 1, "")
    assert kind == "auth" and text.startswith("the model API rejected the API key (401")


def test_codex_model_metadata_warning_is_not_an_error():
    line = ('{"type":"item.completed","item":{"id":"item_0","type":"error","message":"Model metadata for '
            '`standin-model` not found. Defaulting to fallback metadata; this can degrade performance."}}')
    events = get_backend("codex", {}).parse_line(line)
    assert [e.kind for e in events] == [EV_PROGRESS] and events[0].data["message"].startswith("warning:")


def test_codex_unknown_thread_names_the_next_step():
    stderr = ("Error: thread/resume: thread/resume failed: no rollout found for thread id "
              "01a23128-b6a0-71c3-badb-bc0d1784f000 (code -32600)\n")
    kind, text = CodexBackend({}).failure([], 1, stderr)
    assert kind == "exited_nonzero" and "no thread 01a23128-b6a0-71c3-badb-bc0d1784f000" in text
    assert "new session" in text


class ReplayClaude(ClaudeCodeBackend):
    """Claude's recorded lines printed by a tiny program that then exits 0."""

    def __init__(self, fixture: Path):
        super().__init__({})
        self.fixture = fixture

    def command(self, *, prompt, cwd, backend_session_id, env):
        code = f"import sys; sys.stdout.write(open({str(self.fixture)!r}).read())"
        return LaunchSpec(argv=[sys.executable, "-c", code], stdin=None, env=dict(env), cwd=cwd)


def test_an_error_result_followed_by_exit_0_is_a_crash_with_the_backends_reason(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    reporter = ListReporter()
    request = TurnRequest(turn="t-1", session="s-1", cwd=str(work), prompt="hi")
    runner = TurnRunner(request, allowed_cwds=(str(work.resolve()),), default_backend="claude_code",
                        sigint_timeout_s=2.0, reporter=reporter,
                        backend=ReplayClaude(FIXTURES / "claude_code_2.1.328_overloaded.jsonl"))
    asyncio.run(asyncio.wait_for(runner.run(), 30))
    final = reporter.final
    assert final["status"] == "interrupted" and final["reason"] == "crash", final
    assert final["wake_error"]["exit_code"] == 0
    assert final["wake_error"]["summary"].startswith("the model is overloaded (529)")
    assert final["backend_session_id"] == "fdf0cad9-cd0c-4868-94bc-da033e63cc18"


def test_codex_resumed_usage_is_the_turns_share_of_the_threads_total(tmp_path):
    thread = "01a23129-18f9-7bc0-ba37-dd37de3247e7"
    day = tmp_path / "codex" / "sessions" / "2026" / "12" / "01"
    day.mkdir(parents=True)
    record = {"type": "event_msg", "payload": {"type": "token_count", "info": {"total_token_usage": {
        "input_tokens": 22, "cached_input_tokens": 4, "output_tokens": 14}}}}
    (day / f"rollout-2026-12-01T10-31-21-{thread}.jsonl").write_text('{"type":"session_meta"}\n' + json.dumps(record) + "\n")
    backend = CodexBackend({"CODEX_HOME": str(tmp_path / "codex")})
    backend.command(prompt="again", cwd=str(tmp_path), backend_session_id=thread, env={})
    line = ('{"type":"turn.completed","usage":{"input_tokens":33,"cached_input_tokens":6,'
            '"cache_write_input_tokens":0,"output_tokens":21,"reasoning_output_tokens":0}}')
    usage = [e.data for e in backend.parse_line(line) if e.kind == "usage"]
    assert usage == [{"input": 9, "output": 7, "cache_read": 2, "cache_write": 0}]
    fresh = CodexBackend({"CODEX_HOME": str(tmp_path / "codex")})  # a new thread: the figures as printed
    assert [e.data for e in fresh.parse_line(line) if e.kind == "usage"] == [
        {"input": 27, "output": 21, "cache_read": 6, "cache_write": 0}]
