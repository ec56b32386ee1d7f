"""What a turn changed in its working directory (SPEC §1 rule 1, §3.1 ``changes``).

In a git work tree: ``git status --porcelain`` lines, the summary line of ``git diff --stat``
against HEAD (staged and unstaged) and the patch itself (new untracked files included), bounded
by MAX_DIFF_CHARS so a report stays far below the frame limit. Elsewhere: files whose modification time is at or after the
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
MAX_DIFF_CHARS = 64_000
MAX_UNTRACKED_DIFFS = 50
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
        patch, patch_truncated = _patch(cwd, has_head, lines)
    except (OSError, subprocess.SubprocessError):
        return None
    result = {"git": True, "status": lines[:MAX_STATUS_LINES], "diff_stat": stat_lines[-1].strip() if stat_lines else "",
              "head": head, "diff": patch}
    if patch_truncated:
        result["diff_truncated"] = True
    if len(lines) > MAX_STATUS_LINES:
        result["truncated"] = True
        result["status_count"] = len(lines)
    return result


def _patch(cwd: str, has_head: bool, status_lines: list[str]) -> tuple[str, bool]:
    """The diff of tracked files against HEAD, then each new untracked file as an addition."""
    parts = [_git(cwd, "diff", "--no-color", "--no-ext-diff", *(["HEAD"] if has_head else []), "--", ".").stdout]
    if not has_head:
        parts.append(_git(cwd, "diff", "--no-color", "--no-ext-diff", "--cached", "--", ".").stdout)
    untracked = [line[3:] for line in status_lines if line.startswith("?? ")][:MAX_UNTRACKED_DIFFS]
    for path in untracked:
        if sum(map(len, parts)) > MAX_DIFF_CHARS:
            break
        # Exit status 1 means "they differ"; relative to cwd as git status printed it.
        parts.append(_git(cwd, "diff", "--no-color", "--no-ext-diff", "--no-index", "--", "/dev/null",
                          path.strip('"')).stdout)
    text = "".join(parts)
    if len(text) > MAX_DIFF_CHARS:
        return text[:MAX_DIFF_CHARS], True
    return text, False


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
