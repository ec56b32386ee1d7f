"""The lock order of chorus_site/transitions.py, checked where a reader cannot: in the source.

PostgreSQL checks foreign keys at COMMIT with FOR KEY SHARE on the referenced row, which a plain
FOR UPDATE blocks; a transaction that inserted a row (its stream counter locked) then waits at
COMMIT for a row another transaction holds while that one waits for the stream.  Every row lock is
therefore FOR NO KEY UPDATE.  The race tests (tests/*/test_races.py) show the deadlocks this avoids.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPS = ("chorus_site", "sessions_app", "executions")


def _row_locks():
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "select_for_update"):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", node


def test_there_are_row_locks_to_check():
    assert len(list(_row_locks())) >= 8


def test_every_row_lock_is_for_no_key_update():
    plain = [where for where, call in _row_locks()
             if not any(k.arg == "no_key" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in call.keywords)]
    assert plain == [], f"select_for_update() without no_key=True (FOR UPDATE blocks FK checks): {plain}"
