"""Backend adapters: command lines, takeover commands, time limits, and output parsing against
recorded output in tests/agents/fixtures/ (SPEC §5). No database, no Django."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.backends import BACKEND_NAMES, get_backend, summarise_events, usage_total
from agents.backends.base import normalise_usage, summarise
from agents.backends.scripted import PROJECT_ROOT
from agents.protocol import (
    EV_ERROR,
    EV_FINAL,
    EV_OUTCOME,
    EV_PROGRESS,
    EV_REQUIRES_ACTION,
    EV_SESSION,
    EV_TEXT,
    EV_TOOL,
    EVENT_KINDS,
)

FIXTURES = Path(__file__).parent / "fixtures"
CWD = "/srv/work/project"


def parse_fixture(backend_name: str, fixture: str, **environ):
    backend = get_backend(backend_name, environ)
    events = backend.parse_output((FIXTURES / fixture).read_bytes())
    for event in events:  # every event is a protocol kind and travels as JSON
        assert event.kind in EVENT_KINDS
        json.dumps(event.as_dict())
    return events, summarise_events(events)


def of_kind(events, kind):
    return [e.data for e in events if e.kind == kind]


# ------------------------------------------------------------------------------------ registry

def test_registry_has_one_adapter_per_spec_backend():
    assert set(BACKEND_NAMES) == {"claude_code", "codex", "kiro", "dsh", "scripted"}
    for name in BACKEND_NAMES:
        backend = get_backend(name, {})
        assert backend.name == name
        assert backend.stop_signal_first == signal.SIGINT
        assert backend.protocol_stop(object()) is False  # none of the CLI modes has one
    with pytest.raises(KeyError, match="unknown backend"):
        get_backend("gemini")


# ----------------------------------------------------------------------------------- commands

def command(name, session_id=None, **environ):
    return get_backend(name, environ).command(prompt="fix the build\n@reply ok", cwd=CWD,
                                             backend_session_id=session_id, env={"CHORUS_API_URL": "http://p/api/v1"})


def test_claude_code_command_lines():
    new = command("claude_code")
    assert new.argv == ["claude", "-p", "--output-format", "stream-json", "--verbose"]
    assert new.stdin == "fix the build\n@reply ok" and new.cwd == CWD
    assert new.env == {"CHORUS_API_URL": "http://p/api/v1", "DISABLE_AUTOUPDATER": "1"}
    resumed = command("claude_code", "8f6d2c1e", CHORUS_CLAUDE_CODE_ARGS="--permission-mode acceptEdits",
                      CHORUS_CLAUDE_CODE_BIN="/opt/claude/bin/claude")
    assert resumed.argv == ["/opt/claude/bin/claude", "-p", "--output-format", "stream-json", "--verbose",
                            "--resume", "8f6d2c1e", "--permission-mode", "acceptEdits"]


def test_codex_command_lines():
    new = command("codex")
    assert new.argv == ["codex", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write",
                        "--cd", CWD, "-"]
    assert new.stdin.startswith("fix the build")
    resumed = command("codex", "0199a213", CHORUS_CODEX_ARGS="--model gpt-5-codex")
    assert resumed.argv == ["codex", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write",
                            "--cd", CWD, "--model", "gpt-5-codex", "resume", "0199a213", "-"]


def test_kiro_command_lines():
    assert command("kiro").argv == ["kiro-cli", "chat", "--no-interactive", "--trust-all-tools",
                                    "--output-format", "stream-json"]
    assert command("kiro", "f2946a26").argv[-2:] == ["--resume-id", "f2946a26"]
    plain = command("kiro", "f2946a26", CHORUS_KIRO_OUTPUT_FORMAT="text")
    assert "--output-format" not in plain.argv and plain.stdin.startswith("fix the build")


def test_dsh_command_ignores_session_ids():
    assert command("dsh").argv == ["dsh", "exec", "--jsonl", "--ephemeral"]
    assert command("dsh", "ses_1").argv == command("dsh").argv
    assert command("dsh").stdin.startswith("fix the build")
    assert get_backend("dsh", {}).keeps_session is False


def test_scripted_command_finds_the_package_from_any_cwd():
    new = command("scripted", PYTHONPATH="/elsewhere")
    assert new.argv == [sys.executable, "-m", "agents.scripted_agent"]
    assert new.env["PYTHONPATH"].split(":") == [PROJECT_ROOT, "/elsewhere"]
    assert new.env["CHORUS_API_URL"] == "http://p/api/v1"
    assert command("scripted", "abc").argv[-2:] == ["--resume", "abc"]
    assert (Path(PROJECT_ROOT) / "agents" / "scripted_agent.py").is_file()


@pytest.mark.parametrize(("name", "expected"), [
    ("claude_code", "claude --resume 8f6d2c1e-4b7a"),
    ("codex", "codex exec --skip-git-repo-check resume 8f6d2c1e-4b7a"),
    ("kiro", "kiro-cli chat --resume-id 8f6d2c1e-4b7a"),
    ("scripted", f"PYTHONPATH={PROJECT_ROOT} {sys.executable} -m agents.scripted_agent --resume 8f6d2c1e-4b7a"),
    ("dsh", None),
])
def test_takeover_commands(name, expected):
    backend = get_backend(name, {})
    assert backend.takeover_command("8f6d2c1e-4b7a", CWD) == expected
    assert backend.takeover_command(None, CWD) is None  # hidden while the id is unknown


def test_takeover_command_quotes_a_hostile_id():
    assert get_backend("claude_code", {}).takeover_command("x; rm -rf ~", CWD) == "claude --resume 'x; rm -rf ~'"


def test_time_limits():
    assert get_backend("dsh", {}).default_timeout_s == 1800
    assert get_backend("dsh", {"CHORUS_DSH_TIMEOUT_MS": "90000"}).default_timeout_s == 90
    assert get_backend("dsh", {"CHORUS_DSH_TIMEOUT_MS": " 1500 "}).default_timeout_s == 1.5
    for bad in ("soon", "0", "-5", "1e3"):
        with pytest.raises(ValueError, match="CHORUS_DSH_TIMEOUT_MS"):
            get_backend("dsh", {"CHORUS_DSH_TIMEOUT_MS": bad}).default_timeout_s
    for name in ("claude_code", "codex", "kiro", "scripted"):
        assert get_backend(name, {"CHORUS_DSH_TIMEOUT_MS": "5"}).default_timeout_s is None


# ------------------------------------------------------------------------------------ parsing

def test_claude_code_session_fixture():
    events, summary = parse_fixture("claude_code", "claude_code_session.jsonl")
    assert summary["backend_session_id"] == "8f6d2c1e-4b7a-4c55-9a0e-2d31f0b6c9a4"
    assert summary["final_reply"] == "Fixed: invoice totals now round half-up to cents; both invoice tests pass."
    # the result's totals, not the sum of per-message usage
    assert summary["usage"] == {"input": 21, "output": 371, "cache_read": 46264, "cache_write": 5832}
    tools = of_kind(events, EV_TOOL)
    assert [t["name"] for t in tools] == ["Bash", "Edit", "Grep"]
    assert tools[0]["input"]["command"] == "python -m pytest tests/test_invoice.py -q"
    assert tools[2].get("subagent") is True and not tools[0].get("subagent")
    assert [t["text"] for t in of_kind(events, EV_TEXT)] == [
        "I'll look at the failing test first.",
        "Fixed: invoice totals now round half-up to cents; both invoice tests pass."]  # no subagent text
    assert summary["errors"] == [] and summary["requires_action"] is None


def test_claude_code_permission_denials_become_requires_action():
    events, summary = parse_fixture("claude_code", "claude_code_permission_denied.jsonl")
    assert summary["backend_session_id"] == "0c9b8a71-6d5e-4f43-8a21-b0c9d8e7f6a5"
    action = summary["requires_action"]
    assert action["kind"] == "confirmation"
    assert [i["id"] for i in action["items"]] == ["toolu_02Rm"]
    assert "Bash" in action["items"][0]["text"] and "rm -rf build/" in action["items"][0]["text"]
    assert summary["usage"]["output"] == 85


def test_claude_code_auth_failure():
    events, summary = parse_fixture("claude_code", "claude_code_auth_error.jsonl")
    assert summary["final_reply"] is None
    assert summary["errors"] and all(e["kind"] == "auth" for e in summary["errors"])
    assert "Please run /login" in summary["errors"][-1]["message"]
    assert {"text": "Warning: terminal does not support colour", "raw": True} in of_kind(events, EV_TEXT)


def test_codex_session_fixture():
    events, summary = parse_fixture("codex", "codex_session.jsonl")
    assert summary["backend_session_id"] == "0199a213-81c0-7800-8aa1-bbab2a035a53"
    assert summary["final_reply"] == ("Replaced the fixed sleep in test_drain with a 2 s deadline poll; "
                                      "all 3 queue tests pass.")
    assert summary["usage"] == {"input": 315, "output": 122, "cache_read": 24448, "cache_write": 0}
    tools = of_kind(events, EV_TOOL)
    assert [t["name"] for t in tools] == ["shell", "apply_patch", "shell", "tracker.add_comment"]
    assert [t.get("exit_code") for t in tools if t["name"] == "shell"] == [1, 0]
    assert tools[1]["input"]["changes"] == [{"path": "/srv/work/queue/tests/test_queue.py", "kind": "update"}]
    assert any(p["message"].startswith("running: bash -lc") for p in of_kind(events, EV_PROGRESS))
    assert summary["errors"] == []


def test_codex_failed_turn_has_no_final_reply():
    events, summary = parse_fixture("codex", "codex_failed.jsonl")
    assert summary["backend_session_id"] == "0199a2f0-1c2d-7a3b-9e8f-0123456789ab"
    assert summary["final_reply"] is None  # the turn never completed
    assert of_kind(events, EV_TEXT) == [{"text": "Looking at the repository layout."}]  # older item_type
    assert len(summary["errors"]) == 2 and all(e["kind"] == "auth" for e in summary["errors"])
    retries = [p for p in of_kind(events, EV_PROGRESS) if "retry" in p]
    assert [(p["message"], p["retry"]["attempt"], p["retry"]["max_retries"]) for p in retries] == [
        ("retrying: stream interrupted (attempt 1 of 5)", 1, 5)]


def test_kiro_stream_fixture():
    events, summary = parse_fixture("kiro", "kiro_stream.jsonl")
    assert summary["backend_session_id"] == "f2946a26-3735-4b08-8d05-c928010302d5"
    assert summary["final_reply"] == "I'll add the health endpoint. Done: GET /health returns 200."
    assert summary["usage"] == {"input": 1830, "output": 412, "cache_read": 640, "cache_write": 0}
    tools = of_kind(events, EV_TOOL)
    assert [(t["name"], t["id"]) for t in tools] == [("fs_write", "tooluse_7Qe"), ("execute_bash", "tooluse_8Rf")]
    assert tools[0]["input"]["path"] == "api/health.py"


def test_kiro_error_fixture():
    _, summary = parse_fixture("kiro", "kiro_error.jsonl")
    assert summary["backend_session_id"] == "9d0c1b2a-3e4f-4a5b-8c6d-7e8f9a0b1c2d"
    assert summary["final_reply"] is None
    assert summary["errors"][0]["kind"] == "auth"


def test_kiro_plain_transcript():
    events, summary = parse_fixture("kiro", "kiro_plain.txt", CHORUS_KIRO_OUTPUT_FORMAT="text")
    assert summary["backend_session_id"] is None  # plain output names no session: no resume, no takeover
    assert "Done: GET /health returns 200." in summary["final_reply"]
    assert "\x1b" not in summary["final_reply"]
    assert summary["final_reply"].startswith("> I will add the health endpoint.")


def test_dsh_run_fixture():
    events, summary = parse_fixture("dsh", "dsh_run.jsonl")
    assert of_kind(events, EV_SESSION) == [] and summary["backend_session_id"] is None
    assert {"message": "run id", "run_id": "ses_01JZ8Q4M2N"} in of_kind(events, EV_PROGRESS)
    assert summary["final_reply"] == "Dry run loads 1200 rows; the schema drift is fixed."
    assert summary["usage"] == {"input": 1500, "output": 300, "cache_read": 9000, "cache_write": 0}
    assert [(t["name"], t["input"]) for t in of_kind(events, EV_TOOL)] == [
        ("bash", {"command": "python -m etl.load --dry-run"})]
    assert "".join(t["text"] for t in of_kind(events, EV_TEXT)).startswith("Checking the loader.")  # no user text


def test_dsh_failed_fixture():
    _, summary = parse_fixture("dsh", "dsh_failed.jsonl")
    assert summary["final_reply"] is None
    assert summary["errors"] == [{"message": "model request failed: 402 Insufficient Balance", "status": "failed"}]
    assert summary["usage"]["input"] == 420


def test_scripted_fixture():
    events, summary = parse_fixture("scripted", "scripted_turn.jsonl")
    assert summary["backend_session_id"] == "fa54f503-271f-4693-99d4-4004bd1853ad"
    assert [t["name"] for t in of_kind(events, EV_TOOL)] == ["chorus.comment", "chorus.member", "chorus.artifact"]
    assert of_kind(events, EV_TOOL)[1]["input"] == {"key": "api", "prompt": "Build the API"}
    assert summary["outcome"]["intent"] == "waiting" and summary["outcome"]["ref"] == "ISSUE-7"
    assert summary["requires_action"] == {"kind": "confirmation", "items": [
        {"id": "req-1-1", "text": "Deploy to staging?"}, {"id": "req-1-2", "text": "Drop the old table?"}]}
    assert summary["usage"] == {"input": 30, "output": 7, "cache_read": 0, "cache_write": 0}
    assert summary["final_reply"] is None  # the turn waits for an answer
    assert of_kind(events, EV_OUTCOME)[0]["summary"] == "Plan the work."


# --------------------------------------------------------------------------------- robustness

ODD_LINES = [
    "", "   ", "not json at all", "{", "{]", "[1, 2]", "null", "42", '"a string"', '{"type": 5}', "{}",
    '{"type": "assistant", "message": "x"}', '{"type": "assistant", "message": {"content": [1, null, {"type": 7}]}}',
    '{"type": "result", "usage": "bad", "permission_denials": "no"}', '{"type": "result", "is_error": true}',
    '{"type": "item.completed", "item": [1]}', '{"type": "item.completed", "item": {"type": "file_change", '
    '"changes": "x"}}', '{"type": "turn.completed", "usage": {"input_tokens": "many"}}',
    '{"type": "result", "status": "failed", "error": {"message": null}}', '{"type": "tool", "name": {"x": 1}}',
    '{"type": "progress"}', '{"type": "requires_action"}', '{"type": "delta", "delta": ["a", {"text": "b"}]}',
    b"\xff\xfe\x00garbage", "\x1b[31mred text\x1b[0m", '{"type":"text","text":"' + "x" * 100_000 + '"}',
]


@pytest.mark.parametrize("name", ["claude_code", "codex", "kiro", "dsh", "scripted"])
def test_parse_line_never_raises_on_odd_input(name):
    backend = get_backend(name, {})
    events = []
    for line in ODD_LINES:
        parsed = backend.parse_line(line)
        assert isinstance(parsed, list)
        events += parsed
    events += backend.finish(events)
    assert all(e.kind in EVENT_KINDS for e in events)
    assert {"text": "red text", "raw": True} in of_kind(events, EV_TEXT)  # ANSI stripped


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20)
event_types = st.sampled_from(["system", "assistant", "user", "result", "thread.started", "turn.completed",
                               "turn.failed", "error", "item.started", "item.completed", "init", "delta",
                               "message", "toolUse", "runError", "usage", "session", "final", "requires_action",
                               "progress", "member", "outcome", "tool"])


@settings(max_examples=150, deadline=None)
@given(kind=event_types, body=st.dictionaries(st.sampled_from(
    ["message", "item", "usage", "result", "is_error", "subtype", "session_id", "sessionId", "text", "delta",
     "content", "error", "status", "name", "input", "permission_denials", "data", "role", "thread_id"]),
    json_values, max_size=6))
def test_parse_line_never_raises_on_arbitrary_events(kind, body):
    line = json.dumps({"type": kind, **body})
    for name in BACKEND_NAMES:
        backend = get_backend(name, {})
        events = backend.parse_line(line)
        events += backend.finish(events)
        assert all(e.kind in EVENT_KINDS for e in events)
        json.dumps([e.as_dict() for e in events])


# ------------------------------------------------------------------------------------ helpers

def test_usage_normalisation_and_totals():
    assert normalise_usage({"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 7,
                            "cache_creation_input_tokens": 1}) == {"input": 5, "output": 2, "cache_read": 7,
                                                                   "cache_write": 1}
    assert normalise_usage({"inputTokens": "3", "outputTokens": None}) == {"input": 3, "output": 0,
                                                                           "cache_read": 0, "cache_write": 0}
    assert normalise_usage("nope") is None
    events = get_backend("scripted", {}).parse_output('{"type":"usage","input":2,"output":1}\n'
                                                      '{"type":"usage","input":3,"output":"x"}')
    assert usage_total(events) == {"input": 5, "output": 1, "cache_read": 0, "cache_write": 0}


def test_summarise_cuts_large_tool_inputs():
    small = summarise({"file_text": "y" * 5000, "list": list(range(50)), "nested": {"a": {"b": object()}}})
    assert len(small["file_text"]) < 300 and small["file_text"].endswith("(5000 chars)")
    assert len(small["list"]) == 11
    assert isinstance(small["nested"]["a"]["b"], str)


def test_final_and_error_events_are_distinct_evidence():
    """Tool events, the final reply and errors stay separate (SPEC §1 rule 4)."""
    events, _ = parse_fixture("codex", "codex_session.jsonl")
    kinds = {e.kind for e in events}
    assert {EV_TOOL, EV_FINAL, EV_TEXT}.issubset(kinds) and EV_ERROR not in kinds
    assert EV_REQUIRES_ACTION not in kinds and EV_OUTCOME not in kinds  # success is the agent's to report
