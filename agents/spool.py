"""Reliable reports (SPEC §5): every report is on disk before it is sent, and leaves the disk only
when the portal has answered for it.

* ``Spool`` — one JSON file per report in a directory the daemon holds an exclusive lock on. A
  report is written to a temporary name, fsynced and renamed into place (atomic on POSIX), so a
  crash leaves either the whole report or none of it. File names start with a sequence number,
  which keeps the order in which the daemon produced the reports across restarts.
* ``ReportSender`` — sends spooled reports over HTTP. Reports of one *lane* (one turn) go one at a
  time; lanes are independent, so one turn the portal refuses does not hold up the others. A failed
  send is retried with exponential backoff (``kick()`` retries at once, e.g. after a reconnect).
  Within a lane (issue 9 item 1) the steps of a stop (``advance`` with a stop state: signalled,
  escalated, confirmed; interrupted) go *ahead of* output (``events``) still queued, so a stop is
  never late because output queued ahead of it; status changes stay in their order among
  themselves, and the others (running, requires_action, ended) come after the output before them,
  from which the portal derives what the end means (the agent's outcome); output goes in order. While output waits, a new batch of
  events is merged into the lane's last queued events report (up to MERGE_EVENTS_MAX events /
  MERGE_BYTES_MAX bytes, and only while that report was never sent: its file is rewritten
  atomically under the same report id), so a busy turn sends a few large reports, not one per
  flush of its agent's output.

What an answer means: 2xx — applied (or applied before: the portal dedupes by ``report_id`` and
answers the same), the file is deleted. A refusal (409 other than ``idempotency_in_progress``, or
another 4xx except 401/403/408/425/429) is **never dropped**: it is retried with a slow backoff a few
times (the portal decides a refused report again each time — e.g. once the daemon's snapshot has
reconciled the turn), then *parked*: moved to ``parked/``, logged, counted in ``health()`` (which the
daemon sends with its hello, heartbeats and snapshots and the connection's page shows), and retried
on the next reconnect. The lane goes on meanwhile. Anything else (network error, 5xx,
``idempotency_in_progress``, 401/403 while a key is being fixed, 429) — kept and retried, also
after a daemon restart.

Spool writes (write, fsync, rename, fsync of the directory) run in one writer thread, off the event
loop, in the order reports were submitted; a report is queued for sending only once it is on disk.

Standard library only: the daemon side of ``agents/`` imports nothing of the portal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import functools
import json
import logging
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

log = logging.getLogger("chorus.daemon.spool")

NAME_RE = re.compile(r"^(\d{16})-([0-9A-Za-z_.-]{1,80})\.json$")
BACKOFF_FIRST_S = 0.5
BACKOFF_CAP_S = 30.0
RETRY_FOREVER_4XX = {401, 403, 408, 425, 429}
RETRY_CODES_409 = {"idempotency_in_progress"}  # the same report is being applied right now
HTTP_TIMEOUT_S = 20.0
REFUSED_BACKOFF_FIRST_S = 2.0
REFUSED_ATTEMPTS = 6      # a refused report is asked again this often (~1 min at the cap) before it is parked
PARKED_DIR = "parked"
# Bounds of a merged events report: the portal takes up to 1,000 events per report
# (sessions_app/daemon_schemas.EVENTS_PER_REPORT_MAX) in a body of up to 2.5 MB (Django's default).
MERGE_EVENTS_MAX = 1000
MERGE_BYTES_MAX = 1024 * 1024


class SpoolLocked(RuntimeError):
    """Another daemon process holds this spool directory."""


class TransientError(Exception):
    """The report could not be delivered this time (network, timeout); it stays spooled."""


@dataclass
class SpoolEntry:
    seq: int
    name: str
    lane: str      # the turn id, or "daemon" for reports not about one turn
    path: str      # the API path under /api/v1, e.g. /daemon/turns/<id>/advance
    body: dict
    created_at: float
    answer: tuple[int, str] | None = None   # the portal's last answer (status, start of its body)
    submitted: Any = None                   # its _Submitted while this run of the daemon may merge into it

    @property
    def report_id(self) -> str:
        return str(self.body.get("report_id", ""))


class Spool:
    """The on-disk queue of reports. One process at a time (``fcntl.flock`` on ``.lock``)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.bad_dir = os.path.join(directory, "bad")
        self.parked_dir = os.path.join(directory, PARKED_DIR)
        self._lock_fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise SpoolLocked(f"another daemon is using the spool directory {directory}") from None
        for name in os.listdir(directory):  # half-written reports of a daemon that died mid-write
            if name.startswith(".tmp-"):
                _unlink(os.path.join(directory, name))
        self._seq = max((int(m.group(1)) for m in map(NAME_RE.match, os.listdir(directory)) if m), default=0)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def put(self, *, lane: str, path: str, body: dict) -> SpoolEntry:
        """Write one report durably and answer its entry (the report is safe once this returns)."""
        self._seq += 1
        report_id = re.sub(r"[^0-9A-Za-z_.-]", "_", str(body.get("report_id") or "report"))[:80]
        name = f"{self._seq:016d}-{report_id}.json"
        entry = SpoolEntry(seq=self._seq, name=name, lane=lane, path=path, body=body, created_at=time.time())
        data = json.dumps({"lane": lane, "path": path, "body": body, "created_at": entry.created_at},
                          separators=(",", ":"), default=str).encode()
        tmp = os.path.join(self.directory, f".tmp-{name}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.directory, name))
        _fsync_dir(self.directory)
        return entry

    def rewrite(self, entry: SpoolEntry, body: dict) -> SpoolEntry:
        """Replace a spooled report's body durably, atomically, under the same name (a merge)."""
        data = json.dumps({"lane": entry.lane, "path": entry.path, "body": body, "created_at": entry.created_at},
                          separators=(",", ":"), default=str).encode()
        tmp = os.path.join(self.directory, f".tmp-{entry.name}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.directory, entry.name))
        _fsync_dir(self.directory)
        return entry

    def pending(self) -> list[SpoolEntry]:
        """Every spooled report, oldest first. Unreadable files are moved to ``bad/``."""
        return self._entries(self.directory)

    def parked(self) -> list[SpoolEntry]:
        """Reports the portal refused again and again, kept aside (see the module docstring)."""
        if not os.path.isdir(self.parked_dir):
            return []
        return self._entries(self.parked_dir)

    def park(self, entry: SpoolEntry) -> None:
        os.makedirs(self.parked_dir, mode=0o700, exist_ok=True)
        os.replace(os.path.join(self.directory, entry.name), os.path.join(self.parked_dir, entry.name))
        _fsync_dir(self.parked_dir)
        _fsync_dir(self.directory)

    def unpark(self, entry: SpoolEntry) -> None:
        os.replace(os.path.join(self.parked_dir, entry.name), os.path.join(self.directory, entry.name))
        _fsync_dir(self.directory)

    def _entries(self, directory: str) -> list[SpoolEntry]:
        entries = []
        for name in sorted(os.listdir(directory)):
            match = NAME_RE.match(name)
            if not match:
                continue
            full = os.path.join(directory, name)
            try:
                with open(full, "rb") as fh:
                    data = json.loads(fh.read())
                entries.append(SpoolEntry(seq=int(match.group(1)), name=name, lane=str(data["lane"]),
                                          path=str(data["path"]), body=dict(data["body"]),
                                          created_at=float(data.get("created_at") or 0)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("spooled report %s is unreadable (%s); moved to %s", name, exc, self.bad_dir)
                os.makedirs(self.bad_dir, mode=0o700, exist_ok=True)
                try:
                    os.replace(full, os.path.join(self.bad_dir, name))
                except OSError:
                    pass
        return entries

    def remove(self, entry: SpoolEntry) -> None:
        _unlink(os.path.join(self.directory, entry.name))

    def count(self) -> int:
        return sum(1 for name in os.listdir(self.directory) if NAME_RE.match(name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ HTTP

def http_post(url: str, body: dict, *, key: str, timeout: float = HTTP_TIMEOUT_S,
              user_agent: str = "chorus-daemon") -> tuple[int, str]:
    """POST JSON; answer (status, start of the response body). TransientError when no answer came."""
    request = urllib.request.Request(
        url, data=json.dumps(body, separators=(",", ":"), default=str).encode(), method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                 "Accept": "application/json", "User-Agent": user_agent})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 — the portal URL is configured
            return response.status, response.read(2000).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        try:
            text = exc.read(2000).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001
            text = ""
        return exc.code, text
    except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, DNS, TLS, timeout, reset
        raise TransientError(f"{exc.__class__.__name__}: {getattr(exc, 'reason', exc)}") from None


Poster = Callable[[str, dict], Awaitable[tuple[int, str]]]


def error_code(text: str) -> str | None:
    """The ``error.code`` of a §8 error body, if ``text`` is one."""
    try:
        body = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def classify(status: int, text: str = "") -> str:
    """'done' (delete), 'refused' (kept: asked again slowly, then parked — never dropped), or 'retry'."""
    if 200 <= status < 300:
        return "done"
    if status == 409 and error_code(text) in RETRY_CODES_409:
        return "retry"
    if 400 <= status < 500 and status not in RETRY_FOREVER_4XX:
        return "refused"
    return "retry"


# ------------------------------------------------------------------------------------ sender

def is_events_path(path: str) -> bool:
    return path.endswith("/events")


@dataclass
class _Submitted:
    """A report submitted in this run of the daemon: what may still be merged into it."""

    lane: str
    path: str
    body: dict
    events: int = 0
    size: int = 0
    entry: SpoolEntry | None = None      # once on disk
    write: asyncio.Future | None = None  # its latest write (a merge rewrites the file)
    mergeable: bool = False              # an events report never sent (frozen before its first send)
    rewrite_queued: bool = False         # a rewrite waits in the writer: it will write the latest body


class ReportSender:
    """Sends spooled reports, in order per lane, with retries; see the module docstring."""

    def __init__(self, spool: Spool, post: Poster, *, backoff_first_s: float = BACKOFF_FIRST_S,
                 backoff_cap_s: float = BACKOFF_CAP_S, refused_backoff_first_s: float = REFUSED_BACKOFF_FIRST_S,
                 refused_attempts: int = REFUSED_ATTEMPTS):
        self.spool = spool
        self.post = post
        self.backoff_first_s = backoff_first_s
        self.backoff_cap_s = backoff_cap_s
        self.refused_backoff_first_s = refused_backoff_first_s
        self.refused_attempts = max(1, refused_attempts)
        # One writer thread: spool writes leave the event loop but keep the order of submission.
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spool-writer")
        self._writes: set[asyncio.Future] = set()
        self._writing: dict[str, int] = {}          # lane -> reports being written
        self._parked: dict[str, SpoolEntry] = {}   # name -> entry, for health()
        self.refused_total = 0
        self.unspooled = 0                         # reports that could not be written (disk full…), logged
        self.last_refusal: dict | None = None
        self._lanes: dict[str, deque[SpoolEntry]] = {}
        self._tails: dict[str, _Submitted] = {}    # lane -> its last submitted report
        self.merged = 0                            # events reports merged into an earlier one
        self._workers: dict[str, asyncio.Task] = {}
        self._kick = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.delivered = 0

    # -- producing
    def load_pending(self) -> int:
        """Queue what earlier runs of the daemon left in the spool (before anything new)."""
        entries = self.spool.pending()
        for entry in entries:
            self._enqueue(entry)
        self._parked = {entry.name: entry for entry in self.spool.parked()}
        return len(entries)

    def submit(self, *, lane: str, path: str, body: dict) -> asyncio.Future:
        """Spool a report durably in the writer thread, then queue it for sending.

        Returns at once (the event loop never waits on fsync); the future answers the entry once the
        report is on disk, and only then is it queued. ``drain()`` and ``close()`` wait for it.  An
        events report may instead be merged into the lane's last one (see the module docstring).
        """
        self._idle.clear()
        loop = asyncio.get_running_loop()
        merged = self._merge(lane, path, body)
        if merged is not None:
            return merged
        record = _Submitted(lane=lane, path=path, body=body, mergeable=is_events_path(path))
        if record.mergeable:
            record.events, record.size = len(body.get("events") or []), _size(body.get("events"))
        self._tails[lane] = record
        write = loop.run_in_executor(self._writer, self._put, record)
        record.write = write
        self._writes.add(write)
        self._writing[lane] = self._writing.get(lane, 0) + 1
        write.add_done_callback(functools.partial(self._written, lane))  # callbacks run in completion order: the writer's FIFO
        return write

    def _put(self, record: _Submitted) -> SpoolEntry:
        """In the writer thread: the report's first write."""
        record.entry = self.spool.put(lane=record.lane, path=record.path, body=record.body)
        record.entry.submitted = record
        return record.entry

    def _merge(self, lane: str, path: str, body: dict) -> asyncio.Future | None:
        """Append an events report's events to the lane's last report if that is an events report
        never sent and the result stays within the bounds; the future answers once on disk."""
        tail = self._tails.get(lane)
        events = body.get("events")
        if tail is None or not tail.mergeable or tail.path != path or not isinstance(events, list):
            return None
        size = _size(events)
        if tail.events + len(events) > MERGE_EVENTS_MAX or tail.size + size > MERGE_BYTES_MAX:
            return None
        # A new dict and list: the writer thread may still be serialising the previous ones.
        tail.body = {**tail.body, "events": [*tail.body.get("events", []), *events]}
        tail.events += len(events)
        tail.size += size
        if tail.entry is not None:
            tail.entry.body = tail.body
        self.merged += 1
        if tail.rewrite_queued:  # not started yet: it reads the body when it runs, this batch included
            return tail.write
        tail.rewrite_queued = True
        write = asyncio.get_running_loop().run_in_executor(self._writer, self._rewrite, tail)
        tail.write = write
        self._writes.add(write)
        self._writing[lane] = self._writing.get(lane, 0) + 1
        write.add_done_callback(functools.partial(self._rewritten, lane))
        return write

    def _rewrite(self, record: _Submitted) -> SpoolEntry:
        """In the writer thread, after the record's first write (the writer's FIFO).  The body is
        read now, after the flag is cleared: a merge made later queues a rewrite of its own."""
        record.rewrite_queued = False
        body = record.body  # replaced (never changed in place) by the event loop
        if record.entry is None:
            raise OSError("the report this batch was merged into could not be written")
        return self.spool.rewrite(record.entry, body)

    def _write_done(self, lane: str, write: asyncio.Future, what: str) -> bool:
        """The bookkeeping of a finished spool write: True if it succeeded, else counted and logged."""
        self._writes.discard(write)
        self._writing[lane] -= 1
        if not self._writing[lane]:
            del self._writing[lane]
        if write.cancelled() or write.exception() is not None:
            self.unspooled += 1
            log.error("%s could not be written to the spool %s: %s", what, self.spool.directory,
                      "cancelled" if write.cancelled() else write.exception())
            return False
        return True

    def _rewritten(self, lane: str, write: asyncio.Future) -> None:
        # On failure the file keeps the events before this merge; the merged report is still sent
        # whole from memory (a daemon killed before that loses those events, as unflushed output).
        self._write_done(lane, write, "merged events")
        self._maybe_idle()

    def _written(self, lane: str, write: asyncio.Future) -> None:
        if not self._write_done(lane, write, "a report"):
            tail = self._tails.get(lane)
            if tail is not None and tail.entry is None:
                tail.mergeable = False  # nothing on disk to merge into
            self._maybe_idle()
            return
        entry = write.result()
        if entry.submitted is not None:
            entry.body = entry.submitted.body  # merges made while it was being written
        self._enqueue(entry)

    def _maybe_idle(self) -> None:
        if not self._lanes and not self._writes:
            self._idle.set()

    def unpark(self) -> int:
        """Queue the parked reports again (e.g. after a reconnect: the portal may now accept them)."""
        entries = sorted(self._parked.values(), key=lambda e: e.seq)
        for entry in entries:
            try:
                self.spool.unpark(entry)
            except OSError as exc:
                log.error("parked report %s could not be moved back: %s", entry.report_id, exc)
                continue
            del self._parked[entry.name]
            self._enqueue(entry)
        if entries:
            log.info("retrying %d parked report(s)", len(entries))
        return len(entries)

    def health(self) -> dict[str, Any]:
        """What the spool holds, as the daemon reports it to the portal (the connection's page shows it)."""
        now = time.time()
        queued = [e for q in self._lanes.values() for e in q]
        return {
            "queued": len(queued) + len(self._writes),
            "parked": len(self._parked),
            "refused_total": self.refused_total,
            "unspooled": self.unspooled,
            "oldest_queued_age_s": round(now - min(e.created_at for e in queued), 1) if queued else None,
            "oldest_parked_age_s": (round(now - min(e.created_at for e in self._parked.values()), 1)
                                    if self._parked else None),
            "last_refusal": self.last_refusal,
        }

    def _enqueue(self, entry: SpoolEntry) -> None:
        self._lanes.setdefault(entry.lane, deque()).append(entry)
        self._idle.clear()
        if not self._closed and entry.lane not in self._workers:
            self._workers[entry.lane] = asyncio.get_running_loop().create_task(
                self._work(entry.lane), name=f"spool-lane-{entry.lane}")

    # -- control
    def kick(self) -> None:
        """Retry every waiting lane now (e.g. the portal is reachable again)."""
        kick, self._kick = self._kick, asyncio.Event()  # waiters hold the old event; later waits a new one
        kick.set()

    def backlog(self) -> int:
        return sum(len(q) for q in self._lanes.values())

    def lanes(self) -> list[str]:
        """The lanes (turns) with reports waiting to be sent."""
        return [lane for lane, queue in self._lanes.items() if queue]

    def has_pending(self, lane: str) -> bool:
        """Reports of this lane (a turn) wait to be sent."""
        return bool(self._lanes.get(lane)) or lane in self._writing

    async def drain(self, timeout: float) -> bool:
        """Wait until every queued report is delivered or parked; False at the timeout."""
        self.kick()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Stop sending; what is unsent stays in the spool for the next start."""
        self._closed = True
        await asyncio.gather(*list(self._writes), return_exceptions=True)  # every submitted report on disk
        self._writer.shutdown(wait=True)
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        self._workers.clear()

    # -- sending
    async def _work(self, lane: str) -> None:
        queue = self._lanes[lane]
        delay = self.backoff_first_s
        failures = 0
        refusals = 0
        current = None
        try:
            while queue:
                entry = _next_in_lane(queue)
                if entry is not current:  # an advance came in while a report was being retried
                    current, failures, refusals, delay = entry, 0, 0, self.backoff_first_s
                record = entry.submitted
                if record is not None:
                    record.mergeable = False  # frozen: what is sent is what a retry sends again
                    if record.write is not None and not record.write.done():
                        await asyncio.wait([record.write])  # the file holds what is sent
                outcome = await self._send(entry, quiet=failures % 10 != 0)
                if outcome == "retry":
                    failures += 1
                    kicked = await self._wait_retry(delay)
                    delay = self.backoff_first_s if kicked else min(self.backoff_cap_s, delay * 2)
                    continue
                if outcome == "refused":
                    refusals += 1
                    self._note_refusal(entry)
                    if refusals < self.refused_attempts:
                        # Slowly: the portal decides the report again each time (it may accept it once
                        # the daemon's snapshot has reconciled the turn), but no hot loop.
                        await self._wait_retry(self.refused_backoff_first_s * 2 ** (refusals - 1))
                        continue
                    self._park(entry, refusals)
                elif failures or refusals:
                    log.info("report %s delivered after %d failed attempt(s)", entry.report_id, failures + refusals)
                if outcome == "done":
                    self.spool.remove(entry)
                failures = refusals = 0
                delay = self.backoff_first_s
                queue.remove(entry)
                if record is not None and self._tails.get(lane) is record:
                    del self._tails[lane]
        finally:
            if self._workers.get(lane) is asyncio.current_task():
                del self._workers[lane]
            if not queue:
                self._lanes.pop(lane, None)
                if lane not in self._writing:
                    self._tails.pop(lane, None)
            # Cancelled with reports left (close()): they stay in the spool for the next start.
            self._maybe_idle()

    def _note_refusal(self, entry: SpoolEntry) -> None:
        status, text = entry.answer or (0, "")
        self.refused_total += 1
        self.last_refusal = {"report_id": entry.report_id, "path": entry.path, "status": status,
                             "code": error_code(text) or "", "message": text[:300], "at": round(time.time(), 3)}

    def _park(self, entry: SpoolEntry, refusals: int) -> None:
        """Keep a refused report aside: on disk, logged, counted; retried on the next ``unpark()``."""
        status, text = entry.answer or (0, "")
        try:
            self.spool.park(entry)
        except OSError as exc:  # it stays where it is, so the next start sends it again
            log.error("refused report %s could not be parked: %s", entry.report_id, exc)
        self._parked[entry.name] = entry
        log.error("report %s to %s refused by the portal %d time(s) (HTTP %s): %s — parked in %s (kept, shown "
                  "in the connection's spool health, retried on the next reconnect)", entry.report_id, entry.path,
                  refusals, status, text[:500], self.spool.parked_dir)

    async def _send(self, entry: SpoolEntry, *, quiet: bool = False) -> str:
        """One attempt. Failures to retry are logged at INFO on the 1st, 11th, 21st… attempt only."""
        retry_level = logging.DEBUG if quiet else logging.INFO
        try:
            status, text = await self.post(entry.path, entry.body)
        except TransientError as exc:
            log.log(retry_level, "report %s (%s) not delivered: %s; will retry", entry.report_id, entry.path, exc)
            return "retry"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 — a bug in posting must not lose the report
            log.exception("report %s (%s): unexpected error %s; will retry", entry.report_id, entry.path, exc)
            return "retry"
        entry.answer = (status, text)
        outcome = classify(status, text)
        if outcome == "done":
            self.delivered += 1
            log.debug("report %s delivered (%s %s)", entry.report_id, status, entry.path)
        elif outcome == "refused":
            log.warning("report %s to %s refused by the portal (HTTP %s): %s — kept, will ask again",
                        entry.report_id, entry.path, status, text[:500])
        else:
            log.log(retry_level, "report %s to %s: HTTP %s %s; will retry", entry.report_id, entry.path, status,
                    text[:200])
        return outcome

    async def _wait_retry(self, delay: float) -> bool:
        """Sleep ``delay`` (±20 %) or until ``kick()``; True when kicked."""
        jittered = delay * (0.8 + 0.4 * random.random())  # noqa: S311 — jitter, not security
        try:
            await asyncio.wait_for(self._kick.wait(), jittered)
            return True
        except asyncio.TimeoutError:
            return False


def is_stop_report(entry: SpoolEntry) -> bool:
    """A step of a stop (signalled, escalated, confirmed; the turn interrupted by the stop).  A crash
    (interrupted, reason crash) is not one: the portal keeps the reply printed before it."""
    if is_events_path(entry.path):
        return False
    return bool(entry.body.get("stop_state")) or (entry.body.get("status") == "interrupted"
                                                  and entry.body.get("reason") == "user")


def _next_in_lane(queue: deque[SpoolEntry]) -> SpoolEntry:
    """The lane's next report: its oldest status change if that is a step of a stop (it skips the
    output queued before it), else its oldest report.  Other status changes (running,
    requires_action, ended) keep their place after the output before them: the portal derives
    from that output what the end means (the agent's outcome: executions.engine.turn_outcome)."""
    first_status = next((entry for entry in queue if not is_events_path(entry.path)), None)
    return first_status if first_status is not None and is_stop_report(first_status) else queue[0]


def _size(events) -> int:
    return len(json.dumps(events or [], separators=(",", ":"), default=str))


def make_poster(base_url: str, key: str, *, user_agent: str = "chorus-daemon") -> Poster:
    """An async poster for ``ReportSender``: ``base_url`` + path, urllib in a worker thread."""

    async def post(path: str, body: dict) -> tuple[int, str]:
        return await asyncio.to_thread(http_post, base_url + path, body, key=key, user_agent=user_agent)

    return post


def report_path_advance(turn: str) -> str:
    return f"/daemon/turns/{turn}/advance"


def report_path_events(turn: str) -> str:
    return f"/daemon/turns/{turn}/events"


def spool_summary(spool: Spool) -> dict[str, Any]:
    return {"directory": spool.directory, "pending": spool.count(), "parked": len(spool.parked())}
