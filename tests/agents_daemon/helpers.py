"""Small helpers for the daemon tests: waiting on conditions (never fixed sleeps), process checks."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil


async def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02, message: str = ""):
    """Poll ``predicate`` (sync or async) until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout} s {message}".strip())
        await asyncio.sleep(interval)


def pid_alive(pid: int) -> bool:
    """A live process with this pid (a zombie has exited: it cannot run or be signalled)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_quietly(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError):
            pass


class ListReporter:
    """A runner ``Reporter`` that keeps what it was given."""

    def __init__(self):
        self.items: list[tuple[str, dict]] = []

    def advance(self, turn: str, report: dict) -> None:
        self.items.append(("advance", report))

    def events(self, turn: str, events: list[dict]) -> None:
        self.items.append(("events", {"events": events}))

    @property
    def advances(self) -> list[dict]:
        return [r for kind, r in self.items if kind == "advance"]

    @property
    def events_flat(self) -> list[dict]:
        return [e for kind, r in self.items if kind == "events" for e in r["events"]]

    @property
    def final(self) -> dict:
        return self.advances[-1]
