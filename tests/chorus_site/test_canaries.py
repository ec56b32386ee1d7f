"""Canary suite (issue 8, SPEC §11 R6): secrets an agent prints reach no one, anywhere.

Through the real stack (tests/e2e/conftest.py ``bridge``: daphne, a Celery worker with beat, the
daemon, the scripted agent), an agent prints 30+ canaries of different formats from files of its
cwd (the prompt carries only ``@cat FILE`` / ``{file:PATH}`` / ``{env:NAME}``, so no prompt,
command or session record holds them): on stdout (raw lines and JSON lines), on stderr, in a
failing exit, in a requires_action item, in the command line of a process it leaves running, in
its outcome summary, a comment and an artifact it posts with its task token; among them the
daemon's real connection key, the operator's real API token and the agent's own task token.

Then it searches every place a secret could reach: every row of every table, every admin page
and every GET route of the API as each role (the raw views ops_diagnostics may open included),
the troubleshooting exports (redacted, and raw for ops_diagnostics), the portal's, the daemon's
and Celery's logs, the daemon's spool directory and the Redis database (Celery's broker and the
channel layer); and live, while the agent runs: every /ws/live/ frame and every SSE frame each
role receives, every command sent to the Redis database and the arguments of every Celery task
published (tests/secret_search.py ``LiveCapture``).  Figure: canaries × places found — 0 everywhere, the raw views too, because
storage is masked (SPEC §7).  ``bench/canaries.py`` runs this module and prints the figure as JSON
(``CANARY_REPORT`` names the file it is written to).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import string
import textwrap
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib import admin
from django.test import Client
from django.urls import NoReverseMatch, reverse

from chorus_site.api import api
from chorus_site.tokens import token_create
from executions.models import Artifact, Attempt, Run
from sessions_app.models import Turn
from tests.e2e.conftest import (  # noqa: F401 — fixtures
    bridge, celery_beat_worker, kill_group, portal_server, wait_until, workspace,
)
from tests.secret_search import LiveCapture, database_texts

pytestmark = [pytest.mark.django_db(transaction=True)]

_rng = random.Random()  # new secrets every run: nothing can be remembered from an earlier one
ALNUM = string.ascii_letters + string.digits


def rand(n, alphabet=ALNUM):
    return "".join(_rng.choice(alphabet) for _ in range(n))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


CONTROL = "ctl" + rand(16, string.ascii_lowercase)  # ordinary text printed beside the canaries: it must arrive


def canaries(connection_key: str, api_token: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """({canary id: the strings that must be found nowhere}, {file name: its text})."""
    secrets: dict[str, list[str]] = {}

    def canary(cid: str, secret: str, *needles: str) -> str:
        secrets[cid] = [secret, *needles]
        return secret

    pem_body = [rand(64, ALNUM + "+/") for _ in range(4)]
    secrets["pem-private-key-raw-lines"] = pem_body
    split = canary("split-over-two-lines", "ghp_" + rand(36))
    split_lines = textwrap.wrap(f"export GITHUB_TOKEN={split}", 40)
    secrets["split-over-two-lines"] += [part for part in split_lines[1:]]
    b64_secret = "Env-" + rand(30)
    b64_text = b64("API_KEY=" + b64_secret)
    canary("base64-of-a-secret", b64_secret, b64_text)
    basic = "deploy:" + rand(20)
    canary("basic-auth-header", basic.split(":")[1], b64(basic))
    gitlab = canary("json-escaped-in-event", "glpat-" + rand(20))
    hf = canary("json-escaped-raw-line", "hf_" + rand(34))
    out = [
        f"AWS_ACCESS_KEY_ID={canary('aws-access-key-id', 'AKIA' + rand(16, string.ascii_uppercase + '234567'))}",
        f"export AWS_SECRET_ACCESS_KEY={canary('aws-secret-key', rand(40, ALNUM + '/+'))}",
        f"remote: Invalid username or token {canary('github-classic', 'ghp_' + rand(36))}",
        f"GH_TOKEN {canary('github-fine-grained', 'github_pat_' + rand(22) + '_' + rand(59))} expired",
        f"slack_sdk.errors: invalid_auth for {canary('slack-bot-token', 'xoxb-' + rand(12, string.digits) + '-' + rand(13, string.digits) + '-' + rand(24))}",  # noqa: E501
        f"POST https://hooks.slack.com/services/T0{rand(7, string.ascii_uppercase)}/B0{rand(7, string.ascii_uppercase)}/"
        f"{canary('slack-webhook', rand(24))} -> 200",
        f"stripe.error.AuthenticationError: {canary('stripe-key', 'sk_live_' + rand(48))}",
        f"python-http-client: 401 for {canary('sendgrid-key', 'SG.' + rand(22) + '.' + rand(43))}",
        f"openai.AuthenticationError: Incorrect API key provided: {canary('openai-key', 'sk-proj-' + rand(48))}.",
        f"anthropic: 401 for x-api-key {canary('anthropic-key', 'sk-ant-api03-' + rand(93) + 'AA')}",
        f"session cookie {canary('jwt', 'eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.' + rand(60) + '.' + rand(43))}",
        "writing key", "-----BEGIN RSA PRIVATE KEY-----", *pem_body, "-----END RSA PRIVATE KEY-----",
        f"DATABASE_PASSWORD={canary('password-assignment', 'hunter2-' + rand(12))}",
        f"psycopg.OperationalError: postgres://app:{canary('url-credentials', 'Pg-' + rand(18))}@db.internal:5432/app",
        f"> Authorization: Bearer {canary('bearer-header', rand(40))}",
        f"env (base64): {b64_text}",
        *split_lines,
        json.dumps({"type": "text", "text": json.dumps({"log": f"loaded .env\nGITLAB_TOKEN={gitlab}\nok"})}),
        json.dumps({"level": "debug", "msg": f"env\nHF_TOKEN={hf}\ndone"}),
        f"using {canary('chorus-api-token', api_token)} for the portal",
        f"found the daemon's key {canary('chorus-connection-key', connection_key)} in its config",
        f"Authorization: Basic {b64(basic)}",
        f"GET https://maps.googleapis.com/maps/api/geocode/json?key={canary('google-api-key', 'AIza' + rand(35))}",
        f"//registry.npmjs.org/:_authToken={canary('npm-token', 'npm_' + rand(36))}",
        f"huggingface-cli login --token {canary('huggingface-token', 'hf_' + rand(34))}",
        f"DJANGO_SECRET_KEY = \"{canary('quoted-assignment', 'django-insecure-' + rand(30))}\"",
        f"control {CONTROL}-stdout",
    ]
    files = {
        "out.txt": "\n".join(out) + "\n",
        "err.txt": "Traceback (most recent call last):\n"
                   f"requests.exceptions.HTTPError: 401 for https://ci:{canary('stderr-url-credentials', rand(24))}"
                   "@api.example.com/v1\n"
                   f"x-api-key: {canary('stderr-api-key', 'sk-' + rand(48))}\ncontrol {CONTROL}-stderr\n",
        "ra.txt": f"Run the migration with DB_PASSWORD={canary('requires-action-item', 'Ra-' + rand(20))} {CONTROL}-ra?",
        "arg.txt": f"--marker={CONTROL}-cmdline --api-key={canary('background-cmdline', rand(28))} --github {canary('background-cmdline-token', 'ghp_' + rand(36))}",  # noqa: E501
        "summary.txt": f"deploy failed: key {canary('outcome-summary', 'sk_live_' + rand(40))} rejected {CONTROL}-summary",
        "comment.txt": f"progress: SLACK_BOT_TOKEN={canary('agent-comment', 'xoxb-' + rand(12, string.digits) + '-' + rand(24))} {CONTROL}-comment",
        "artifact.txt": f"# Report\nAWS_SECRET_ACCESS_KEY={canary('agent-artifact', rand(40))}\n{CONTROL}-artifact\n",
    }
    return secrets, files


RUN_PROMPT = """@cat out.txt
@stderr-file err.txt
@stderr CHORUS_TASK_TOKEN={env:CHORUS_TASK_TOKEN}
@write token.txt {env:CHORUS_TASK_TOKEN}
@comment {file:comment.txt}
@artifact notes.md {file:artifact.txt}
@background 120 {file:arg.txt}
@reply {file:summary.txt}
@outcome failed
@exit 3
{file:summary.txt}"""

PERSONAS = ("viewer", "operator", "diagnostics_reader", "ops_admin_user")


def admin_pages(client, rows: int = 8) -> list[str]:
    """What the user gets from every changelist it may open and the change pages of its newest rows."""
    pages = [client.get("/admin/").content.decode()]
    for model in admin.site._registry:
        meta = model._meta
        try:
            changelist = reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist")
        except NoReverseMatch:
            continue
        answer = client.get(changelist)
        if answer.status_code != 200:
            continue
        pages.append(answer.content.decode())
        for pk in model.objects.order_by("-pk").values_list("pk", flat=True)[:rows]:
            pages.append(client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[pk]))
                         .content.decode())
    return pages


def api_routes(ids: dict[str, list]) -> list[str]:
    """Every GET route of the OpenAPI document, once per id of the objects the scenario made."""
    urls = []
    for path, operations in api.get_openapi_schema()["paths"].items():
        if "get" not in operations or path.endswith("/events/stream"):
            continue  # the SSE streams send what the events routes list
        names = re.findall(r"{(\w+)}", path)
        if not all(name in ids for name in names):
            continue
        combos = [{}]
        for name in names:
            combos = [{**c, name: value} for c in combos for value in ids[name]]
        urls += [path.format(**combo) for combo in combos]
    extra = [f"/api/v1/turns/{t}/diagnostics?redacted=1" for t in ids["turn_id"]]
    extra += [f"/api/v1/sessions/{s}/troubleshooting?format=md" for s in ids["session_id"]]
    extra += [f"/api/v1/runs/{r}/troubleshooting?format=md" for r in ids["run_id"]]
    return urls + extra


def raw_exports(ids) -> list[str]:
    """The unredacted exports with captured details: ops_diagnostics only (SPEC §7, §9)."""
    return ([f"/api/v1/sessions/{s}/troubleshooting?redacted=0&details=1" for s in ids["session_id"]]
            + [f"/api/v1/sessions/{s}/troubleshooting?redacted=0&details=1&format=md" for s in ids["session_id"]]
            + [f"/api/v1/runs/{r}/troubleshooting?redacted=0&details=1" for r in ids["run_id"]])


def redis_texts() -> str:
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    parts = []
    for key in client.scan_iter(count=500):
        kind = client.type(key).decode()
        if kind == "string":
            parts.append(client.get(key) or b"")
        elif kind == "list":
            parts += client.lrange(key, 0, -1)
        elif kind == "hash":
            parts += list(client.hgetall(key).values())
        elif kind == "zset":
            parts += client.zrange(key, 0, -1)
        elif kind == "set":
            parts += list(client.smembers(key))
    return "\n".join(p.decode("utf-8", "replace") for p in parts)


def file_texts(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file()) if root.exists() else ""


def follow_live(capture: LiveCapture, *, session_ids=(), run_ids=()):
    """Every role follows these sessions and runs live, on its socket and by SSE, from their first event."""
    capture.follow(streams=[f"session:{s}" for s in session_ids] + [f"run:{r}" for r in run_ids],
                   sse_paths=[f"/api/v1/sessions/{s}/events/stream?after=0" for s in session_ids]
                   + [f"/api/v1/runs/{r}/events/stream?after=0" for r in run_ids])


def scenario(bridge, operator, tmp_path, capture: LiveCapture) -> dict:
    api_client, workspace = bridge["api"], bridge["workspace"]
    secrets, files = canaries(bridge["key"], api_client.token)
    for name, text in files.items():
        (workspace / name).write_text(text)
    status, issue = api_client.call("POST", "/issues", {"title": "Deploy the service", "body": "Deploy it."})
    assert status == 201, issue
    capture.follow(streams=[f"issue:{issue['id']}", f"connection:{bridge['connection'].pk}"])
    status, started = api_client.call("POST", "/runs", {
        "issue": issue["id"], "mode": "direct", "target": {"connection": str(bridge["connection"].pk)},
        "input": {"prompt": RUN_PROMPT}})
    assert status == 201, started
    follow_live(capture, run_ids=[started["run"]])
    status, session = api_client.call("POST", "/sessions", {
        "connection": str(bridge["connection"].pk), "cwd": str(workspace), "prompt": "@require-approval {file:ra.txt}"})
    assert status == 201, session
    follow_live(capture, session_ids=[session["session"]])
    # The attempt's own session, as soon as the run has one (its stream is followed from its start).
    task_session = wait_until(lambda: Attempt.objects.filter(task__node__run_id=started["run"])
                              .exclude(session_id=None).values_list("session_id", flat=True).first(),
                              timeout=60, message="the attempt's session")
    follow_live(capture, session_ids=[task_session])
    run = wait_until(lambda: (r := Run.objects.get(pk=started["run"])).state in {"failed", "succeeded"} and r,
                     timeout=60, message="the run to end")
    attempt = Attempt.objects.get(task__node__run=run)
    waiting = wait_until(lambda: Turn.objects.filter(pk=session["turn"], status="requires_action").first(),
                         timeout=30, message="the session's turn to wait for an answer")
    turn = Turn.objects.get(pk=attempt.turn_id)
    wait_until(lambda: (workspace / "token.txt").exists(), timeout=10, message="the agent's task token")
    secrets["chorus-task-token"] = [(workspace / "token.txt").read_text().strip()]
    assert secrets["chorus-task-token"][0].startswith("cht_")
    return {"secrets": secrets, "run": run, "attempt": attempt, "turn": turn, "waiting": waiting}


def places(bridge, world, personas, tmp_path) -> dict[str, str]:
    """{place: the text a reader of it gets}."""
    run, attempt, turn, waiting = world["run"], world["attempt"], world["turn"], world["waiting"]
    ids = {"connection_id": [bridge["connection"].pk], "session_id": [turn.session_id, waiting.session_id],
           "turn_id": [turn.pk, waiting.pk], "run_id": [run.pk], "issue_id": [run.issue_id],
           "task_id": [attempt.task_id], "attempt_id": [attempt.pk],
           "artifact_id": list(Artifact.objects.values_list("pk", flat=True))}
    texts = {f"db:{table}": text for table, text in database_texts().items()}
    routes = api_routes(ids)
    for name in PERSONAS:
        user = personas[name]
        client = Client()
        client.force_login(user)
        texts[f"admin pages ({name})"] = "\n".join(admin_pages(client))
        _token, raw = token_create(user=user, name="canary-crawler")
        answers = [Client().get(url, HTTP_AUTHORIZATION=f"Bearer {raw}") for url in routes]
        assert all(a.status_code < 500 for a in answers)
        texts[f"api routes ({name})"] = "\n".join(a.content.decode() for a in answers)
    diag = Client()
    diag.force_login(personas["diagnostics_reader"])
    answers = [diag.get(url) for url in raw_exports(ids)]
    assert all(a.status_code == 200 for a in answers), [a.status_code for a in answers]
    texts["raw exports (ops_diagnostics)"] = "\n".join(a.content.decode() for a in answers)
    for log in sorted(tmp_path.glob("*.log")):
        texts[f"log:{log.stem}"] = log.read_text(errors="replace")
    texts["daemon spool"] = file_texts(tmp_path / "spool")
    texts["redis"] = redis_texts()
    return texts


def figure(secrets: dict[str, list[str]], texts: dict[str, str]) -> dict:
    found = {cid: sorted(place for place, text in texts.items() if any(n in text for n in needles))
             for cid, needles in secrets.items()}
    found = {cid: where for cid, where in found.items() if where}
    return {"canaries": len(secrets), "places": len(texts), "found": sum(map(len, found.values())),
            "by_canary": found, "place_names": sorted(texts)}


def live_capture(bridge, personas) -> LiveCapture:
    """Each role signed in (a session cookie for /ws/live/, an API token for SSE) before the agent starts."""
    roles = {}
    for name in PERSONAS:
        client = Client()
        client.force_login(personas[name])
        roles[name] = (client.cookies[settings.SESSION_COOKIE_NAME].value,
                       token_create(user=personas[name], name="canary-live")[1])
    return LiveCapture(bridge["portal"], roles, os.environ["REDIS_URL"]).start()


def test_no_canary_reaches_any_place(bridge, operator, personas, tmp_path):
    started = time.monotonic()
    capture = live_capture(bridge, personas)
    try:
        world = scenario(bridge, operator, tmp_path, capture)
    finally:
        live = capture.stop()
    scenario_s = time.monotonic() - started
    try:
        secrets = world["secrets"]
        assert len(secrets) >= 25
        turn = world["turn"]
        # The scenario did what it says: every channel was used and stored (masked) text.
        assert turn.wake_error["kind"] == "exited_nonzero" and "Traceback" in turn.wake_error["details"]
        assert turn.background_processes and "--api-key=" in turn.background_processes[0]["cmdline"]
        assert world["waiting"].requires_action["items"][0]["text"].startswith("Run the migration with DB_PASSWORD=")
        assert world["attempt"].outcome["intent"] == "failed" and "rejected" in world["attempt"].outcome["summary"]
        assert Artifact.objects.filter(name="notes.md").exists()
        assert world["run"].issue.comments.filter(body__startswith="progress: SLACK_BOT_TOKEN=").exists()
        started = time.monotonic()
        texts = {**places(bridge, world, personas, tmp_path), **live}
        # The live capture reached what the agent printed and what Celery was asked to do.
        for name in PERSONAS:
            assert f"{CONTROL}-stdout" in texts[f"ws frames ({name})"], name
            assert f"{CONTROL}-stdout" in texts[f"sse frames ({name})"], name
        assert str(world["run"].pk) in texts["celery task arguments"]
        search_s = time.monotonic() - started
        assert "[REDACTED]" in texts["db:chorus_site_event"]
        result = figure(secrets, texts)
        # The search reaches what the agent printed: the ordinary text beside each canary is there.
        controls = {c: sorted(p for p, text in texts.items() if f"{CONTROL}-{c}" in text)
                    for c in ("stdout", "stderr", "ra", "cmdline", "summary", "comment", "artifact")}
        result["controls_found_in"] = controls
        result["seconds"] = {"scenario": round(scenario_s, 1), "search": round(search_s, 1)}
        if os.environ.get("CANARY_REPORT"):
            Path(os.environ["CANARY_REPORT"]).write_text(json.dumps(result, indent=1))
        for where in controls.values():
            # (stderr only in diagnostics details: for ops_diagnostics, not for viewers, SPEC §7)
            assert any(p.startswith("db:") for p in where) and any(p.startswith("api routes") for p in where), controls
        assert result["by_canary"] == {}, result["by_canary"]
    finally:
        for t in Turn.objects.exclude(background_processes=None):
            for proc in t.background_processes or []:
                kill_group(proc.get("pid"))
