"""The report spool: durable, ordered per turn, retried, resent after a restart, exactly once."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from agents.spool import ReportSender, Spool, SpoolLocked, TransientError, classify

from .helpers import wait_until


class FakePortal:
    """An async poster: answers from ``answers`` (status per path prefix) or is down."""

    def __init__(self):
        self.down = False
        self.received: list[tuple[str, dict]] = []
        self.applied: dict[str, int] = {}     # report_id -> times applied (the portal dedupes)
        self.status_for: dict[str, int] = {}  # report_id -> forced status

    async def post(self, path: str, body: dict):
        await asyncio.sleep(0)
        if self.down:
            raise TransientError("ConnectionRefusedError: portal down")
        self.received.append((path, body))
        status = self.status_for.get(body["report_id"], 200)
        if status == 200:
            self.applied[body["report_id"]] = self.applied.get(body["report_id"], 0) + 1
        return status, json.dumps({"status": status})


def test_put_is_atomic_and_ordered(tmp_path):
    spool = Spool(str(tmp_path))
    first = spool.put(lane="t1", path="/daemon/turns/t1/advance", body={"report_id": "a", "status": "running"})
    spool.put(lane="t2", path="/daemon/turns/t2/events", body={"report_id": "b", "events": []})
    spool.put(lane="t1", path="/daemon/turns/t1/advance", body={"report_id": "c", "status": "ended"})
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if n.startswith(".tmp-")]
    assert [e.report_id for e in spool.pending()] == ["a", "b", "c"]
    assert json.loads((tmp_path / first.name).read_text())["body"] == {"report_id": "a", "status": "running"}
    spool.remove(first)
    spool.remove(first)  # twice is fine
    assert [e.report_id for e in spool.pending()] == ["b", "c"]
    spool.close()


def test_half_written_and_corrupt_files_on_open(tmp_path):
    spool = Spool(str(tmp_path))
    spool.put(lane="t", path="/p", body={"report_id": "ok"})
    spool.close()
    (tmp_path / ".tmp-0000000000000009-x.json").write_text('{"lane": "t", "pa')   # a crash mid-write
    (tmp_path / "0000000000000005-bad.json").write_text("{not json")
    spool = Spool(str(tmp_path))
    assert not (tmp_path / ".tmp-0000000000000009-x.json").exists()
    assert [e.report_id for e in spool.pending()] == ["ok"]
    assert (tmp_path / "bad" / "0000000000000005-bad.json").exists()
    # numbering continues after what is on disk: new reports sort after old ones
    entry = spool.put(lane="t", path="/p", body={"report_id": "new"})
    assert entry.seq > 5
    assert [e.report_id for e in spool.pending()] == ["ok", "new"]
    spool.close()


def test_one_daemon_per_spool_dir(tmp_path):
    spool = Spool(str(tmp_path))
    with pytest.raises(SpoolLocked):
        Spool(str(tmp_path))
    spool.close()
    Spool(str(tmp_path)).close()


IN_PROGRESS = json.dumps({"error": {"code": "idempotency_in_progress", "message": "retry shortly", "detail": {}}})
REFUSED = json.dumps({"error": {"code": "invalid_transition", "message": "turn ended", "detail": {}}})


@pytest.mark.parametrize("status, text, outcome", [
    (200, "", "done"), (201, "", "done"), (204, "", "done"),
    (400, "", "refused"), (404, "", "refused"), (409, "", "refused"), (409, REFUSED, "refused"), (422, "", "refused"),
    (409, IN_PROGRESS, "retry"),
    (401, "", "retry"), (403, "", "retry"), (408, "", "retry"), (429, "", "retry"), (500, "", "retry"),
    (502, "", "retry"), (503, "", "retry"),
])
def test_classify(status, text, outcome):
    assert classify(status, text) == outcome


async def test_sends_in_order_per_lane_and_deletes_after_2xx(tmp_path):
    portal = FakePortal()
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01)
    for i in range(5):
        for lane in ("t1", "t2"):
            sender.submit(lane=lane, path=f"/daemon/turns/{lane}/events",
                          body={"report_id": f"{lane}-{i}", "events": [{"kind": "text", "data": {"n": i}}]})
    assert await sender.drain(5)
    for lane in ("t1", "t2"):  # every event once, in order (batches may have been merged: issue 9)
        sent = [event["data"]["n"] for path, body in portal.received if f"/{lane}/" in path for event in body["events"]]
        assert sent == list(range(5))
    assert spool.count() == 0
    await sender.close()
    spool.close()


async def test_refused_reports_are_parked_never_dropped_and_do_not_block_the_lane(tmp_path):
    """Issue 7 item 3: a refusal is asked again slowly, then parked on disk, counted and retried later."""
    portal = FakePortal()
    portal.status_for = {"r1": 409, "r2": 400}
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01, refused_backoff_first_s=0.01,
                          refused_attempts=3)
    for rid in ("r1", "r2", "r3"):
        sender.submit(lane="t", path="/daemon/turns/t/advance", body={"report_id": rid})
    assert await sender.drain(5)
    assert [b["report_id"] for _, b in portal.received] == ["r1"] * 3 + ["r2"] * 3 + ["r3"]
    assert sender.delivered == 1 and spool.count() == 0
    assert sorted(n.split("-", 1)[1] for n in os.listdir(tmp_path / "parked")) == ["r1.json", "r2.json"]
    health = sender.health()
    assert (health["queued"], health["parked"], health["refused_total"]) == (0, 2, 6)
    assert health["oldest_parked_age_s"] is not None and health["last_refusal"]["report_id"] == "r2"
    assert health["last_refusal"]["status"] == 400
    await sender.close()
    spool.close()

    # Kept across a restart, and sent again once the portal takes them (e.g. after a reconnect).
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01)
    assert sender.load_pending() == 0 and sender.health()["parked"] == 2
    portal.status_for = {}
    assert sender.unpark() == 2
    assert await sender.drain(5)
    assert portal.applied == {"r1": 1, "r2": 1, "r3": 1}
    assert sender.health()["parked"] == 0 and not os.listdir(tmp_path / "parked") and spool.count() == 0
    await sender.close()
    spool.close()


async def test_a_409_in_progress_is_retried_until_applied(tmp_path):
    answers = [(409, IN_PROGRESS), (409, IN_PROGRESS), (200, "{}")]
    seen = []

    async def post(path, body):
        seen.append(body["report_id"])
        return answers.pop(0)

    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, post, backoff_first_s=0.01, refused_attempts=1)
    sender.submit(lane="t", path="/p", body={"report_id": "x"})
    assert await sender.drain(5)
    assert seen == ["x", "x", "x"] and sender.delivered == 1 and sender.health()["parked"] == 0
    await sender.close()
    spool.close()


async def test_spool_writes_run_off_the_event_loop_and_a_report_is_on_disk_before_it_is_sent(tmp_path):
    import threading

    spool = Spool(str(tmp_path))
    writers = []
    put = spool.put

    def recording_put(**kwargs):
        writers.append(threading.current_thread())
        return put(**kwargs)

    spool.put = recording_put
    on_disk = []

    async def post(path, body):
        on_disk.append(any(n.endswith(f"-{body['report_id']}.json") for n in os.listdir(tmp_path)))
        return 200, ""

    sender = ReportSender(spool, post, backoff_first_s=0.01)
    futures = [sender.submit(lane="t", path="/p", body={"report_id": f"r{i}"}) for i in range(20)]
    assert await sender.drain(5)
    assert writers and all(t is not threading.main_thread() for t in writers)
    assert on_disk == [True] * 20
    assert [(await f).report_id for f in futures] == [f"r{i}" for i in range(20)]  # in submission order
    await sender.close()
    spool.close()


async def test_close_waits_for_every_submitted_report_to_be_on_disk(tmp_path):
    portal = FakePortal()
    portal.down = True
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01)
    for i in range(10):
        sender.submit(lane="t", path="/p", body={"report_id": f"r{i}"})
    await sender.close()
    spool.close()
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".json")]) == 10


async def test_retries_with_backoff_and_blocks_only_its_lane(tmp_path):
    portal = FakePortal()
    portal.status_for = {"stuck": 503}
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01, backoff_cap_s=0.05)
    sender.submit(lane="a", path="/a", body={"report_id": "stuck"})
    sender.submit(lane="a", path="/a", body={"report_id": "after-stuck"})
    sender.submit(lane="b", path="/b", body={"report_id": "other"})
    await wait_until(lambda: portal.applied.get("other") == 1)
    await wait_until(lambda: sum(1 for _, b in portal.received if b["report_id"] == "stuck") >= 4)
    assert "after-stuck" not in portal.applied  # strictly in order within the lane
    portal.status_for = {}
    sender.kick()
    assert await sender.drain(5)
    assert portal.applied == {"other": 1, "stuck": 1, "after-stuck": 1}
    await sender.close()
    spool.close()


async def test_portal_down_then_daemon_restart_resends_everything_once_in_order(tmp_path):
    portal = FakePortal()
    portal.down = True
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01, backoff_cap_s=0.02)
    sender.submit(lane="t1", path="/daemon/turns/t1/advance", body={"report_id": "run", "status": "running"})
    sender.submit(lane="t1", path="/daemon/turns/t1/events", body={"report_id": "ev", "events": [{"kind": "text"}]})
    sender.submit(lane="t1", path="/daemon/turns/t1/advance", body={"report_id": "end", "status": "ended"})
    assert not await sender.drain(0.2)
    await sender.close()          # the daemon stops (or dies) with the portal still down
    spool.close()
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".json")]) == 3

    portal.down = False           # the portal is back; the daemon starts again
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01)
    assert sender.load_pending() == 3
    sender.submit(lane="t1", path="/daemon/turns/t1/events", body={"report_id": "later", "events": []})
    assert await sender.drain(5)
    # An end keeps its place after the output before it (its outcome is derived from that output).
    assert [b["report_id"] for _, b in portal.received] == ["run", "ev", "end", "later"]
    assert portal.applied == {"run": 1, "ev": 1, "end": 1, "later": 1}
    assert spool.count() == 0
    await sender.close()
    spool.close()


async def test_a_failing_poster_never_loses_a_report(tmp_path):
    calls = []

    async def broken(path, body):
        calls.append(body["report_id"])
        if len(calls) < 3:
            raise RuntimeError("bug")
        return 200, ""

    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, broken, backoff_first_s=0.01)
    sender.submit(lane="t", path="/p", body={"report_id": "x"})
    assert await sender.drain(5)
    assert calls == ["x", "x", "x"] and spool.count() == 0
    await sender.close()
    spool.close()


# ---------------------------------------------------------------- issue 9 item 1: batches, status first
def events_body(report_id, first, count):
    return {"report_id": report_id, "events": [{"kind": "text", "data": {"n": n}} for n in range(first, first + count)]}


def sent_events(portal):
    return [e["data"]["n"] for path, body in portal.received if path.endswith("/events") for e in body["events"]]


async def test_a_stop_confirmation_queued_behind_bulk_output_is_sent_first(tmp_path):
    portal = FakePortal()
    portal.down = True
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01, backoff_cap_s=0.02)
    writes = [sender.submit(lane="t", path="/daemon/turns/t/advance", body={"report_id": "run", "status": "running"})]
    for i in range(40):
        writes.append(sender.submit(lane="t", path="/daemon/turns/t/events", body=events_body(f"ev{i}", 10 * i, 10)))
    writes.append(sender.submit(lane="t", path="/daemon/turns/t/advance", body={
        "report_id": "stop", "status": "interrupted", "reason": "user", "stop_state": "confirmed"}))
    await asyncio.gather(*writes)  # all on disk while the portal is down
    portal.down = False
    assert await sender.drain(5)
    order = [body["report_id"] for _, body in portal.received]
    assert order[:2] == ["run", "stop"]  # not behind the 40 batches of output
    assert sent_events(portal) == list(range(400))  # the output still comes, whole and in order
    assert spool.count() == 0
    await sender.close()
    spool.close()


async def test_an_end_comes_after_its_output_and_a_later_stop_does_not_pass_it(tmp_path):
    portal = FakePortal()
    portal.down = True
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01, backoff_cap_s=0.02)
    writes = [sender.submit(lane="t", path="/daemon/turns/t/advance", body={"report_id": "run", "status": "running"})]
    writes += [sender.submit(lane="t", path="/daemon/turns/t/events", body=events_body(f"ev{i}", 10 * i, 10))
               for i in range(5)]
    writes.append(sender.submit(lane="t", path="/daemon/turns/t/advance", body={"report_id": "end", "status": "ended"}))
    writes.append(sender.submit(lane="t", path="/daemon/turns/t/advance", body={
        "report_id": "late-stop", "status": "interrupted", "reason": "user", "stop_state": "confirmed"}))
    await asyncio.gather(*writes)
    portal.down = False
    assert await sender.drain(5)
    order = [body["report_id"] for _, body in portal.received]
    assert order[0] == "run" and order[-2:] == ["end", "late-stop"]  # status changes keep their order
    assert sent_events(portal) == list(range(50))
    await sender.close()
    spool.close()


async def test_a_crash_comes_after_the_output_before_it(tmp_path):
    """A crash is not a stop: the portal keeps the reply the agent printed before it (the partial
    reply of the transcript, issue 10), so its report must not pass the output queued ahead of it."""
    portal = FakePortal()
    portal.down = True
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01, backoff_cap_s=0.02)
    writes = [sender.submit(lane="t", path="/daemon/turns/t/advance", body={"report_id": "run", "status": "running"})]
    writes += [sender.submit(lane="t", path="/daemon/turns/t/events", body=events_body(f"ev{i}", 10 * i, 10))
               for i in range(5)]
    writes.append(sender.submit(lane="t", path="/daemon/turns/t/advance", body={
        "report_id": "crash", "status": "interrupted", "reason": "crash",
        "wake_error": {"kind": "crash", "summary": "exit 3"}}))
    await asyncio.gather(*writes)
    portal.down = False
    assert await sender.drain(5)
    order = [body["report_id"] for _, body in portal.received]
    assert order[0] == "run" and order[-1] == "crash"
    assert sent_events(portal) == list(range(50))
    await sender.close()
    spool.close()


async def test_queued_batches_of_a_turn_are_merged_within_bounds_and_on_disk(tmp_path):
    from agents.spool import MERGE_EVENTS_MAX

    portal = FakePortal()
    portal.down = True
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01, backoff_cap_s=0.02)
    batches, size = 60, 30
    for i in range(batches):
        sender.submit(lane="t", path="/daemon/turns/t/events", body=events_body(f"ev{i}", size * i, size))
    assert not await sender.drain(0.1)
    await sender.close()  # the daemon stops with the portal down: the merged reports are on disk
    spool.close()
    spool = Spool(str(tmp_path))
    stored = spool.pending()
    assert len(stored) < batches / 10
    assert [e["data"]["n"] for entry in stored for e in entry.body["events"]] == list(range(batches * size))
    portal.down = False
    sender = ReportSender(spool, portal.post, backoff_first_s=0.01)
    assert sender.load_pending() == len(stored)
    assert await sender.drain(5)
    assert sent_events(portal) == list(range(batches * size))  # once each, in order
    assert all(len(body["events"]) <= MERGE_EVENTS_MAX for _, body in portal.received)
    assert len(portal.received) == len(stored) and spool.count() == 0
    await sender.close()
    spool.close()


async def test_a_report_once_sent_is_never_merged_into(tmp_path):
    """Its retry must carry what the portal may already have applied under its report id."""
    portal = FakePortal()
    portal.status_for = {"ev0": 503}
    spool = Spool(str(tmp_path))
    sender = ReportSender(spool, portal.post, backoff_first_s=0.05, backoff_cap_s=0.05)
    sender.submit(lane="t", path="/daemon/turns/t/events", body=events_body("ev0", 0, 5))
    await wait_until(lambda: portal.received, timeout=5)
    for i in range(1, 4):
        sender.submit(lane="t", path="/daemon/turns/t/events", body=events_body(f"ev{i}", 5 * i, 5))
    await wait_until(lambda: len(portal.received) >= 2, timeout=5)
    portal.status_for = {}
    assert await sender.drain(5)
    first_sends = [body for _, body in portal.received if body["report_id"] == "ev0"]
    assert all(len(body["events"]) == 5 for body in first_sends)
    assert portal.applied["ev0"] == 1 and sent_events(portal)[-15:] == list(range(5, 20))
    await sender.close()
    spool.close()
