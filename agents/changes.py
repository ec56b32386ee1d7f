"""What a turn changed in its working directory (SPEC §1 rule 1, §3.1 ``changes``).

In a git work tree: ``git status --porcelain`` lines and the summary line of ``git diff --stat``
against HEAD (staged and unstaged). Elsewhere: files whose modification time is at or after the
spawn, found by a bounded walk (deleted files cannot be seen this way). Blocking: the daemon runs
it in a worker thread. Standard library only.
"""

from __future__ import annotations

import math
import os
import subprocess

GIT_TIMEOUT_S = 15.0
MAX_STATUS_LINES = 500
MAX_FILES = 500
MAX_WALK_ENTRIES = 20000
SKIP_DIRS = {".git", ".hg", ".svn"}


def _git(cwd: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                          env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"},
                          stdin=subprocess.DEVNULL, errors="replace")


def git_changes(cwd: str) -> dict | None:
    """None when ``cwd`` is not inside a git work tree (or git is missing)."""
    try:
        inside = _git(cwd, "rev-parse", "--is-inside-work-tree")
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        status = _git(cwd, "status", "--porcelain", "--untracked-files=all", "--", ".")
        lines = [line for line in status.stdout.splitlines() if line.strip()]
        has_head = _git(cwd, "rev-parse", "--verify", "--quiet", "HEAD").returncode == 0
        diff = _git(cwd, "diff", "--stat", *(["HEAD"] if has_head else []), "--", ".")
        stat_lines = [line for line in diff.stdout.splitlines() if line.strip()]
        head = _git(cwd, "rev-parse", "HEAD").stdout.strip() if has_head else None
    except (OSError, subprocess.SubprocessError):
        return None
    result = {"git": True, "status": lines[:MAX_STATUS_LINES], "diff_stat": stat_lines[-1].strip() if stat_lines else "",
              "head": head}
    if len(lines) > MAX_STATUS_LINES:
        result["truncated"] = True
        result["status_count"] = len(lines)
    return result


def files_modified_since(cwd: str, since: float) -> dict:
    """Files under ``cwd`` modified at or after ``since`` (whole seconds: coarse file systems)."""
    threshold = math.floor(since)
    files: list[str] = []
    visited = 0
    truncated = False
    for root, dirs, names in os.walk(cwd, onerror=lambda exc: None):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(names):
            visited += 1
            if visited > MAX_WALK_ENTRIES:
                truncated = True
                break
            path = os.path.join(root, name)
            try:
                if os.lstat(path).st_mtime >= threshold:
                    files.append(os.path.relpath(path, cwd))
            except OSError:
                continue
        if truncated:
            break
    result = {"git": False, "files": files[:MAX_FILES]}
    if truncated or len(files) > MAX_FILES:
        result["truncated"] = True
    return result


def collect_changes(cwd: str, since: float) -> dict:
    """The ``changes`` of an advance report; never raises."""
    try:
        return git_changes(cwd) or files_modified_since(cwd, since)
    except Exception as exc:  # noqa: BLE001 — a report without changes beats no report
        return {"git": False, "files": [], "error": f"{exc.__class__.__name__}: {exc}"[:300]}
