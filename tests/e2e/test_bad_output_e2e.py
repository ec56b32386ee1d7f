"""Bad agent output never wedges a turn (issue 8 item 7), end to end: a real portal, a real daemon
spawning the scripted agent, a real Celery worker with beat.

One NUL byte in agent output used to fail the events report with a 500 on every retry: the turn
stayed running and the reports stayed in the daemon's spool.  Here the agent prints NUL bytes,
and JSON lines with escaped NUL and lone surrogates, on stdout and stderr; the turn
ends, the text is stored with U+FFFD and the spool drains.
"""

from __future__ import annotations

import pytest

from chorus_site.models import Event
from sessions_app.models import Turn
from tests.e2e.conftest import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_nul_and_surrogates_in_agent_output_end_the_turn_and_drain_the_spool(bridge, tmp_path):
    printed = bridge["workspace"] / "bad-output.txt"
    printed.write_bytes(b"raw nul \x00 byte here\n"
                        b'{"type": "text", "text": "json nul \\u0000 and half \\ud800 surrogate"}\n'
                        b'{"type": "progress", "message": "low \\udfff alone", "k\\u0000": "v"}\n')
    status, body = bridge["api"].call("POST", "/sessions", {
        "connection": str(bridge["connection"].pk), "cwd": str(bridge["workspace"]),
        "prompt": f"@cat {printed}\n@stderr-file {printed}\n@reply done \\u0000 despite it"})
    assert status == 201, body
    turn = wait_until(lambda: (t := Turn.objects.get(pk=body["turn"])).status in ("ended", "interrupted") and t,
                      timeout=60, message="the turn to settle")
    assert turn.status == "ended", (turn.status, turn.wake_error.get("details", "")[-1500:])
    texts = " ".join(str(event.data) for event in Event.objects.filter(stream=turn.stream, kind="turn.output"))
    assert "json nul \ufffd and half \ufffd surrogate" in texts
    assert "low \ufffd alone" in texts
    assert "\x00" not in texts
    wait_until(lambda: not list((tmp_path / "spool").rglob("*.json")), timeout=30, message="an empty spool")
