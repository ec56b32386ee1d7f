"""Project-level guarantees: migrations in sync, deploy checks clean, strict settings, embedded mode."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION_SECRET = "x7#Kp2!vQ9@mZ4$wL8^nR3&tY6*bH1(cJ5)dF0-gS" + "e" * 20


def manage(*args, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DJANGO_", "CHORUS_")) and k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(extra)
    return env


def test_migrations_match_the_models(tmp_path):
    result = manage("makemigrations", "--check", "--dry-run", env=clean_env(CHORUS_DATA_DIR=str(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_deploy_check_is_clean_with_production_values(tmp_path):
    env = clean_env(DATABASE_URL="postgres://root@127.0.0.1:5432/test", REDIS_URL="redis://127.0.0.1:6379/0",
                    DJANGO_SECRET_KEY=PRODUCTION_SECRET, DJANGO_DEBUG="0", DJANGO_ALLOWED_HOSTS="ops.example.com",
                    CHORUS_DATA_DIR=str(tmp_path))
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


@pytest.mark.parametrize("variable, value, words", [
    ("DJANGO_DEBUG", "maybe", "DJANGO_DEBUG"),
    ("CHORUS_EVENT_RETENTION_DAYS", "seven", "CHORUS_EVENT_RETENTION_DAYS"),
    ("CHORUS_EVENT_RETENTION_DAYS", "0", "at least 1"),
    ("DATABASE_URL", "mysql://root@localhost/x", "DATABASE_URL"),
    ("REDIS_URL", "localhost:6379", "REDIS_URL"),
    ("DJANGO_ALLOWED_HOSTS", "a,,b", "DJANGO_ALLOWED_HOSTS"),
])
def test_malformed_settings_stop_start_up_with_a_clear_message(tmp_path, variable, value, words):
    env = clean_env(CHORUS_DATA_DIR=str(tmp_path), DJANGO_SECRET_KEY="k", **{variable: value})
    result = manage("check", env=env)
    assert result.returncode != 0
    assert words in result.stderr
    assert "Traceback" not in result.stderr.splitlines()[-1]


def test_production_mode_requires_a_secret_key(tmp_path):
    result = manage("check", env=clean_env(DATABASE_URL="postgres://root@127.0.0.1:5432/test",
                                           CHORUS_DATA_DIR=str(tmp_path)))
    assert result.returncode != 0
    assert "DJANGO_SECRET_KEY" in result.stderr


def test_embedded_mode_smoke(tmp_path):
    """SQLite, in-memory layer, in-process tasks: migrate, demo data, serve, log in, read the API."""
    env = clean_env(CHORUS_DATA_DIR=str(tmp_path))
    assert manage("migrate", "--noinput", "-v0", env=env).returncode == 0
    first = manage("chorus_demo", env=env)
    assert first.returncode == 0, first.stderr
    demo = manage("chorus_demo", env=env)  # idempotent: data kept, passwords renewed
    assert demo.returncode == 0, demo.stderr
    assert "already present" in demo.stdout
    logins = {line.split()[0]: line.split()[1] for line in demo.stdout.splitlines() if " role ops_" in line}
    assert set(logins) == {"viewer", "operator", "diagnostics", "admin"}
    assert (tmp_path / "chorus.sqlite3").exists()

    port = free_port()
    # What `make run` starts: the portal, a local daemon with the scripted agent, the sweeps.
    server = subprocess.Popen([sys.executable, "manage.py", "chorus_serve", "--port", str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def serving():
            try:
                return urllib.request.urlopen(base + "/admin/login/", timeout=1).status == 200
            except OSError:
                return False

        wait_until(serving, timeout=30, message="embedded portal to serve")
        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        opener.open(base + "/admin/login/")
        csrf = next(c.value for c in jar if c.name == "csrftoken")
        form = urllib.parse.urlencode({"username": "viewer", "password": logins["viewer"],
                                       "csrfmiddlewaretoken": csrf, "next": "/admin/"}).encode()
        page = opener.open(urllib.request.Request(base + "/admin/login/", data=form,
                                                  headers={"Referer": base + "/admin/login/"}))
        html = page.read().decode()
        assert "Sessions" in html and "Executions" in html
        sessions = opener.open(base + "/admin/sessions_app/session/").read().decode()
        assert "Fix the flaky payments test" in sessions
        static = urllib.request.urlopen(base + "/static/chorus/live.js", timeout=5)
        assert static.status == 200

        # A new user can start a session on the local daemon and watch it end.
        token = manage("chorus_token", "create", "--user", "operator", env=env).stdout.strip().splitlines()[-1]

        def call(path, body=None):
            request = urllib.request.Request(base + "/api/v1" + path, method="POST" if body else "GET",
                                             data=json.dumps(body).encode() if body else None,
                                             headers={"Authorization": f"Bearer {token}",
                                                      "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())

        local = wait_until(lambda: next((c for c in call("/connections?status=online")["items"]
                                         if c["name"] == "local-scripted"), None), timeout=30,
                           message="the local daemon to come online")
        started = call("/sessions", {"connection": local["id"], "cwd": local["cwds"][0],
                                     "prompt": "@write hello.txt hi\n@reply Embedded works"})
        turn = wait_until(lambda: (t := call(f"/turns/{started['turn']}"))["status"] == "ended" and t, timeout=30,
                          message="the embedded turn to end")
        assert turn["final_reply"] == "Embedded works"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_make_run_ends_its_start_up_with_the_url_and_logins_and_stops_on_ctrl_c(tmp_path):
    """`make run` as a newcomer runs it: the last start-up lines are the URL, the demo logins (which
    work) and how to stop; the local daemon stays connected (no error in the log); Ctrl-C stops
    everything."""
    port = free_port()
    env = clean_env(CHORUS_DATA_DIR=str(tmp_path))
    log_path = tmp_path / "make-run.log"
    with open(log_path, "w") as log:
        # -o: the venv is taken as installed (the test runs from it); nothing is downloaded.
        make = subprocess.Popen(["make", "-o", ".venv/.installed", "run", f"PORT={port}"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: "Stop: press Ctrl-C" in log_path.read_text() or make.poll() is not None, timeout=120,
                       message="make run to finish starting")
            text = log_path.read_text()
            tail = text[text.rindex("Chorus Ops is running"):].splitlines()
            assert tail[0] == f"Chorus Ops is running: open http://127.0.0.1:{port}/admin/"
            logins = {line.split()[0]: line.split()[1] for line in tail if line.endswith(("ops_viewer",
                      "ops_operator", "ops_diagnostics", "ops_admin"))}
            assert set(logins) == {"viewer", "operator", "diagnostics", "admin"}
            assert any(line.startswith("Stop: press Ctrl-C") for line in tail)
            # The printed password is the valid one.
            jar = CookieJar()
            opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
            base = f"http://127.0.0.1:{port}"
            opener.open(base + "/admin/login/")
            csrf = next(c.value for c in jar if c.name == "csrftoken")
            form = urllib.parse.urlencode({"username": "operator", "password": logins["operator"],
                                           "csrfmiddlewaretoken": csrf, "next": "/admin/"}).encode()
            page = opener.open(urllib.request.Request(base + "/admin/login/", data=form,
                                                      headers={"Referer": base + "/admin/login/"}))
            assert page.geturl().endswith("/admin/")
            # The local daemon's heartbeats are stored (SQLite has no jsonb: they were a 1011 loop).
            wait_until(lambda: 'id="spool-queued"' in _local_connection_page(opener, base), timeout=30,
                       message="the local daemon's spool health to be stored")
            assert "Exception inside application" not in log_path.read_text()
        finally:
            os.killpg(make.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches the whole group
            make.wait(timeout=60)
    assert "Exception inside application" not in log_path.read_text()
    left = subprocess.run(["pgrep", "-f", f"(--port|-p) {port}( |$)"], capture_output=True, text=True).stdout
    assert left == "", left  # portal, daemon and sweeps all stopped


def _local_connection_page(opener, base) -> str:
    html = opener.open(base + "/admin/sessions_app/connection/?q=local-scripted").read().decode()
    match = re.search(r'href="/admin/sessions_app/connection/([0-9a-f-]{36})/change/', html)
    if not match:
        return ""
    return opener.open(base + f"/admin/sessions_app/connection/{match.group(1)}/change/").read().decode()
