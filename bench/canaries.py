"""R6 figure: canaries × places found (issue 8 canary suite), printed as JSON.

    DATABASE_URL=postgres://... REDIS_URL=redis://.../N .venv/bin/python bench/canaries.py

Runs tests/chorus_site/test_canaries.py (the real stack: daphne, a Celery worker with beat, the
daemon and the scripted agent, on a test database pytest-django creates from DATABASE_URL) and
prints what it measured: how many canaries, how many places were searched (every table, admin
pages and API routes per role, raw exports, logs, the daemon's spool, Redis, and live: WebSocket
and SSE frames per role, Redis commands, Celery task arguments), in how many
canary × place pairs a secret was found (with where), and where the ordinary control text was
found (proof that the search reaches the agent's output).  Exit status: pytest's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    for name in ("DATABASE_URL", "REDIS_URL"):
        if not os.environ.get(name):
            sys.exit(f"{name} is required (the suite runs the real stack)")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "canaries.json"
        env = {"DJANGO_SECRET_KEY": "bench-only-secret", "DJANGO_HTTPS": "0", **os.environ,
               "CANARY_REPORT": str(report)}
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                               "tests/chorus_site/test_canaries.py"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if not report.exists():
            sys.stderr.write(done.stdout[-4000:])
            return done.returncode or 1
        result = json.loads(report.read_text())
    result["pairs_searched"] = result["canaries"] * result["places"]
    result["passed"] = done.returncode == 0
    print(json.dumps(result, indent=1))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
