"""A report the portal refuses is never dropped silently (issue 7 item 3): the daemon keeps it, parks
it after a few slow attempts, says so in the spool health of its heartbeats, and sends it again after
a reconnect. Against the stand-in portal of test_daemon (a real WebSocket server)."""

from __future__ import annotations

import json
import os

from agents import protocol as p

from .helpers import wait_until
from .test_daemon import make_daemon, portal, start_payload, workdir  # noqa: F401 — fixtures

REFUSED = json.dumps({"error": {"code": "invalid_transition", "message": "the turn was settled offline",
                                "detail": {}}})


async def test_a_refused_end_report_is_parked_shown_and_sent_again_after_a_reconnect(portal, make_daemon,
                                                                                     workdir, tmp_path):
    refusing = {"on": True}
    accept = portal.post

    async def post(path, body):
        if refusing["on"] and body.get("status") == "ended":
            portal.reports.append((path + "#refused", body))
            return 409, REFUSED
        return await accept(path, body)

    portal.post = post
    daemon, _ = await make_daemon()
    daemon.sender.post = post
    daemon.sender.refused_backoff_first_s = 0.01
    daemon.sender.refused_attempts = 3
    daemon.heartbeat_interval_s = 1.0

    await portal.command(p.START_TURN, "turn-r", start_payload(workdir, "@reply hi"))
    await wait_until(lambda: daemon.sender.health()["parked"] == 1, 20)
    refused = [b for path, b in portal.reports if path.endswith("#refused")]
    assert len(refused) == 3 and len({b["report_id"] for b in refused}) == 1  # the same report, asked again
    parked = os.listdir(tmp_path / "spool" / "parked")
    assert len(parked) == 1 and parked[0].endswith(f"-{refused[0]['report_id']}.json")

    def last_health():
        beats = [m for m in portal.messages if m["type"] == p.HEARTBEAT and m.get("spool")]
        return beats[-1]["spool"] if beats else None

    await wait_until(lambda: (last_health() or {}).get("parked") == 1, 10)
    health = last_health()
    assert health["last_refusal"]["status"] == 409 and health["last_refusal"]["code"] == "invalid_transition"
    assert health["oldest_parked_age_s"] is not None and health["refused_total"] == 3

    # The portal would take it now; after a reconnect the daemon sends it again, once.
    refusing["on"] = False
    hellos = len(portal.hellos)
    await portal.connections[-1].close()
    await wait_until(lambda: len(portal.hellos) > hellos, 20)
    assert portal.hellos[-1]["spool"]["parked"] in (0, 1)
    await wait_until(lambda: "ended" in portal.statuses("turn-r"), 10)
    assert [b["report_id"] for b in portal.advances("turn-r") if b.get("status") == "ended"] == [refused[0]["report_id"]]
    await wait_until(lambda: daemon.sender.health()["parked"] == 0, 5)
    assert not os.listdir(tmp_path / "spool" / "parked")
