"""Turns a dead daemon left behind.

While an agent runs, the daemon keeps a small record of it on disk (``<spool dir>/running/<turn>.json``:
pid, start time, process group, marker, cwd). A daemon that stops normally removes it after the
turn's last report is spooled. If the daemon was killed (SIGKILL, power loss, OOM), the records are
still there at the next start, and ``recover_orphans`` settles each one:

* whatever of the turn's process tree still runs is stopped with the verified stop — found by pid
  *and* start time, by process group while provably ours, and by the turn's marker variable in the
  environment (a process that merely reuses a pid is never touched);
* the turn is reported ``interrupted(shutdown)`` with the changes in its cwd (its output after the
  daemon died is lost; the portal refuses the report if the turn was settled meanwhile, which is fine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from typing import Any

from agents import protocol as p
from agents.changes import collect_changes
from agents.proctree import ProcRecord, TreeSampler, TreeTracker, same_process, stop_tree

log = logging.getLogger("chorus.daemon.orphans")

SAFE_NAME = re.compile(r"[^0-9A-Za-z_.-]")


class RunningRegistry:
    """One JSON file per running turn, written atomically."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def _path(self, turn: str) -> str:
        return os.path.join(self.directory, SAFE_NAME.sub("_", turn)[:120] + ".json")

    def add(self, record: dict[str, Any]) -> None:
        path = self._path(record["turn"])
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def remove(self, turn: str) -> None:
        try:
            os.unlink(self._path(turn))
        except FileNotFoundError:
            pass

    def load(self) -> list[dict[str, Any]]:
        records = []
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if name.endswith(".tmp"):
                os.unlink(path)
                continue
            if not name.endswith(".json"):
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    record = json.load(fh)
                int(record["pid"]), float(record["start_time"]), str(record["turn"])  # noqa: B018 — validate
                records.append(record)
            except (OSError, ValueError, KeyError, TypeError):
                log.error("unreadable running-turn record %s; removed", path)
                os.unlink(path)
        return records


async def recover_orphans(records: list[dict[str, Any]], registry: RunningRegistry, *, reporter,
                          sampler: TreeSampler, sigint_timeout_s: float) -> list[str]:
    """Stop and report the turns an earlier run of the daemon left running (``registry.load()``
    taken at start, before this run registers its own). Answers their ids."""
    recovered = []
    for record in records:
        turn = str(record["turn"])
        root = ProcRecord(pid=int(record["pid"]), start_time=float(record["start_time"]),
                          cmdline=str(record.get("cmdline") or ""))
        tracker = TreeTracker(root, pgid=int(record.get("pgid") or root.pid),
                              spawned_at=float(record.get("spawned_at") or root.start_time),
                              marker=str(record.get("marker") or turn))
        result = await stop_tree(tracker, sampler, timeout_s=sigint_timeout_s,
                                 leader_exited=lambda root=root: not same_process(root))
        if result.first_step == "none":
            log.warning("turn %s was running when the daemon died; nothing of it runs any more", turn)
        else:
            log.warning("turn %s was running when the daemon died; its process tree was stopped (%s)", turn,
                        "confirmed" if result.confirmed else "NOT confirmed")
        cwd = record.get("cwd")
        changes = await asyncio.to_thread(collect_changes, cwd, tracker.spawned_at) if cwd and os.path.isdir(cwd) else None
        report = p.AdvanceReport(
            report_id=p.new_report_id(), status=p.INTERRUPTED, reason="shutdown",
            stop_state=p.STOP_CONFIRMED if result.confirmed else None, changes=changes,
            background_processes=[r.as_report() for r in result.survivors] or None).as_dict()
        reporter.advance(turn, report)
        registry.remove(turn)
        recovered.append(turn)
    return recovered
