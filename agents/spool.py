"""Reliable reports (SPEC §5): every report is on disk before it is sent, and leaves the disk only
when the portal has answered for it.

* ``Spool`` — one JSON file per report in a directory the daemon holds an exclusive lock on. A
  report is written to a temporary name, fsynced and renamed into place (atomic on POSIX), so a
  crash leaves either the whole report or none of it. File names start with a sequence number,
  which keeps the order in which the daemon produced the reports across restarts.
* ``ReportSender`` — sends spooled reports over HTTP. Reports of one *lane* (one turn) go strictly
  in order, one at a time, so a turn's events arrive before its final ``advance``; lanes are
  independent, so one turn the portal refuses does not hold up the others. A failed send is
  retried with exponential backoff (``kick()`` retries at once, e.g. after a reconnect).

What an answer means: 2xx — applied (or applied before: the portal dedupes by ``report_id``), the
file is deleted. 409 — the portal refuses it for good (e.g. the turn already ended) or has it
already: deleted, logged. Other 4xx except 401/403/408/425/429 — the report is invalid, retrying
cannot help: deleted, logged. Anything else (network error, 5xx, 401/403 while a key is being
fixed, 429) — kept and retried, also after a daemon restart.

Standard library only: the daemon side of ``agents/`` imports nothing of the portal.
"""

from __future__ import annotations

import asyncio
import fcntl
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
HTTP_TIMEOUT_S = 20.0


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

    @property
    def report_id(self) -> str:
        return str(self.body.get("report_id", ""))


class Spool:
    """The on-disk queue of reports. One process at a time (``fcntl.flock`` on ``.lock``)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.bad_dir = os.path.join(directory, "bad")
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

    def pending(self) -> list[SpoolEntry]:
        """Every spooled report, oldest first. Unreadable files are moved to ``bad/``."""
        entries = []
        for name in sorted(os.listdir(self.directory)):
            match = NAME_RE.match(name)
            if not match:
                continue
            full = os.path.join(self.directory, name)
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


def classify(status: int) -> str:
    """'done' (delete), 'drop' (delete: refused for good), or 'retry'."""
    if 200 <= status < 300:
        return "done"
    if 400 <= status < 500 and status not in RETRY_FOREVER_4XX:
        return "drop"
    return "retry"


# ------------------------------------------------------------------------------------ sender

class ReportSender:
    """Sends spooled reports, in order per lane, with retries; see the module docstring."""

    def __init__(self, spool: Spool, post: Poster, *, backoff_first_s: float = BACKOFF_FIRST_S,
                 backoff_cap_s: float = BACKOFF_CAP_S):
        self.spool = spool
        self.post = post
        self.backoff_first_s = backoff_first_s
        self.backoff_cap_s = backoff_cap_s
        self._lanes: dict[str, deque[SpoolEntry]] = {}
        self._workers: dict[str, asyncio.Task] = {}
        self._kick = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.delivered = 0
        self.dropped = 0

    # -- producing
    def load_pending(self) -> int:
        """Queue what earlier runs of the daemon left in the spool (before anything new)."""
        entries = self.spool.pending()
        for entry in entries:
            self._enqueue(entry)
        return len(entries)

    def submit(self, *, lane: str, path: str, body: dict) -> SpoolEntry:
        """Spool a report durably, then queue it for sending. Returns once it is on disk."""
        entry = self.spool.put(lane=lane, path=path, body=body)
        self._enqueue(entry)
        return entry

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

    def has_pending(self, lane: str) -> bool:
        """Reports of this lane (a turn) wait to be sent."""
        return bool(self._lanes.get(lane))

    async def drain(self, timeout: float) -> bool:
        """Wait until every queued report is delivered or dropped; False at the timeout."""
        self.kick()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Stop sending; what is unsent stays in the spool for the next start."""
        self._closed = True
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
        try:
            while queue:
                entry = queue[0]
                outcome = await self._send(entry, quiet=failures % 10 != 0)
                if outcome == "retry":
                    failures += 1
                    kicked = await self._wait_retry(delay)
                    delay = self.backoff_first_s if kicked else min(self.backoff_cap_s, delay * 2)
                    continue
                if failures:
                    log.info("report %s delivered after %d failed attempt(s)", entry.report_id, failures)
                failures = 0
                delay = self.backoff_first_s
                self.spool.remove(entry)
                queue.popleft()
        finally:
            if self._workers.get(lane) is asyncio.current_task():
                del self._workers[lane]
            if not queue:
                self._lanes.pop(lane, None)
            # Cancelled with reports left (close()): they stay in the spool for the next start.
            if not self._lanes:
                self._idle.set()

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
        outcome = classify(status)
        if outcome == "done":
            self.delivered += 1
            log.debug("report %s delivered (%s %s)", entry.report_id, status, entry.path)
        elif outcome == "drop":
            self.dropped += 1
            log.warning("report %s to %s refused by the portal (HTTP %s): %s — dropped",
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
    return {"directory": spool.directory, "pending": spool.count()}
