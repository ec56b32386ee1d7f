"""Issue 11, "Broken or misleading now": what an operator sees, in a real browser (Debian Chromium)
against one live stack for the whole module: daphne, a Celery worker with beat, and the daemon
spawning the scripted agent in a git work tree made the way the demo makes its workspace.

The stack is shared (starting it costs seconds), so the tests run with autocommit access to the
test database instead of a per-test transaction, and the module flushes the database at its end.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
from django.core.management import call_command
from django.test.utils import override_settings
from playwright.sync_api import expect

from chorus_site import permissions
from chorus_site.tokens import token_create
from executions.models import Attempt, Run
from sessions_app import services
from sessions_app.models import Turn
from tests import factories
from tests.conftest import role_group
from tests.e2e.conftest import CHROMIUM, Api, Daemon, admin_login, free_port, kill_group, start_portal, stop_process
from tests.e2e.conftest import test_database_url as database_url  # not collected as a test here
from tests.e2e.conftest import wait_online, wait_until

pytestmark = [pytest.mark.browser]

SIGINT_TIMEOUT_S = 2


def _celery_beat_worker(tmp):
    env = {**os.environ, "DATABASE_URL": database_url(), "CHORUS_DATA_DIR": str(tmp)}
    log_path = tmp / "celery-beat.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "chorus_site", "worker", "-B", "--pool=solo", "--concurrency=1",
         "--without-gossip", "--without-mingle", "--loglevel=INFO", "-s", str(tmp / "beat-schedule")],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), env=env, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "ready" in log_path.read_text() or process.poll() is not None, timeout=60,
                   message="the Celery worker to be ready")
        if process.poll() is not None:
            raise AssertionError(log_path.read_text()[-3000:])
    except BaseException:
        stop_process(process)
        log.close()
        raise
    return process, log


@pytest.mark.django_db
def test_the_stack_uses_the_test_database():
    """pytest-django sets up the test database only for the databases its collected tests are
    marked with: this mark makes sure it does when this module runs alone."""
    from django.db import connection

    assert connection.settings_dict["NAME"].startswith("test_")


@pytest.fixture(scope="module")
def stack(django_db_setup, django_db_blocker, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    from executions.management.commands.chorus_demo import demo_workspace

    tmp = tmp_path_factory.mktemp("console")
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's sync API keeps a loop on this thread
    with django_db_blocker.unblock(), contextlib.ExitStack() as cleanup:
        # Everything started is stopped even when a later step of the set-up fails: a worker left
        # running would take the next run's tasks from the same Redis queue.
        cleanup.callback(_close_connections)  # last (callbacks run in reverse): after the flush
        cleanup.callback(call_command, "flush", interactive=False, verbosity=0)
        with override_settings(DATA_DIR=str(tmp)):
            workspace = demo_workspace()  # as make run makes it: a git repository of its own
        port = free_port()
        portal = f"http://127.0.0.1:{port}"
        portal_process = start_portal(port, tmp)
        cleanup.callback(stop_process, portal_process)
        worker, worker_log = _celery_beat_worker(tmp)
        cleanup.callback(worker_log.close)
        cleanup.callback(stop_process, worker)
        connection, key = services.connection_register(name="console-daemon", backend="scripted",
                                                       cwds=[str(workspace)], sigint_timeout_s=SIGINT_TIMEOUT_S)
        daemon = Daemon(portal, key, str(workspace), tmp, sigint_timeout_s=SIGINT_TIMEOUT_S).start()
        cleanup.callback(_kill_agents)
        cleanup.callback(daemon.stop)
        operator = factories.make_user(username="console-operator", groups=[role_group(permissions.OPERATOR)])
        _token, raw = token_create(user=operator, name="console")
        wait_online(connection)
        playwright = cleanup.enter_context(sync_playwright())
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        cleanup.callback(browser.close)
        page = browser.new_page()
        admin_login(page, portal, operator)
        yield {"portal": portal, "api": Api(portal, raw), "connection": connection, "daemon": daemon,
               "workspace": workspace, "page": page, "browser": browser, "operator": operator, "tmp": tmp}
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


def _kill_agents():
    for turn in Turn.objects.exclude(pid=None):
        kill_group(turn.pid)


def _close_connections():
    """The test database is dropped at the end of the session: nothing of this module may hold it."""
    from django.db import connections

    for connection in connections.all():
        connection.close()
        getattr(connection, "close_pool", lambda: None)()


@pytest.fixture(autouse=True)
def _autocommit_db(django_db_blocker):
    """The portal process must see what a test writes: no wrapping transaction."""
    with django_db_blocker.unblock():
        yield


def start(stack, prompt: str) -> Turn:
    status, body = stack["api"].call("POST", "/sessions", {
        "connection": str(stack["connection"].pk), "cwd": str(stack["workspace"]), "prompt": prompt})
    assert status == 201, body
    return Turn.objects.get(pk=body["turn"])


def wait_turn(turn, predicate, message, timeout=30) -> Turn:
    def check():
        fresh = Turn.objects.get(pk=turn.pk)
        return fresh if predicate(fresh) else None

    return wait_until(check, timeout=timeout, message=message)


def test_ten_runs_made_within_a_second_have_unique_visible_ids(stack):
    page, portal = stack["page"], stack["portal"]
    issue = factories.make_issue(title="Ten at once")
    runs = [factories.make_run(issue=issue) for _ in range(10)]
    # Time-ordered ids made together share their head: what the list showed before.
    assert len({str(r.pk)[:8] for r in runs}) < 10
    page.goto(f"{portal}/admin/executions/run/?q={issue.pk}")
    shown = page.locator("#result_list tbody .field-id_short").all_inner_texts()
    assert len(shown) == 10 and len(set(shown)) == 10, shown
    page.goto(f"{portal}/admin/executions/issue/{issue.pk}/change/")
    on_issue = [t for t in page.locator("a[href*='/executions/run/'] .chorus-id").all_inner_texts()]
    assert len(set(on_issue)) == 10, on_issue
    # Titles and breadcrumbs name things, never a UUID or "Sessions › Sessions".
    turn = factories.make_turn(session=factories.make_session(title="Readable session"))
    page.goto(f"{portal}/admin/sessions_app/turn/{turn.pk}/change/")
    crumbs = page.locator(".breadcrumbs").inner_text()
    assert "Agents › Turns" in crumbs and "turn 1 of Readable session" in crumbs, crumbs
    assert str(turn.session_id) not in page.title() + crumbs
    page.goto(f"{portal}/admin/sessions_app/session/")
    assert "Sessions › Sessions" not in page.locator(".breadcrumbs").inner_text()


def test_write_shows_changes_as_files_and_a_diff_and_the_takeover_command_runs_as_printed(stack):
    page, portal = stack["page"], stack["portal"]
    turn = start(stack, "@write hello.txt Hi from the agent\n@reply Wrote hello.txt")
    turn = wait_turn(turn, lambda t: t.status == "ended", "the @write turn to end")
    page.goto(f"{portal}/admin/sessions_app/turn/{turn.pk}/change/")
    changes = page.locator("#chorus-changes li")
    expect(changes).to_have_count(1)
    expect(changes.first).to_contain_text("hello.txt")
    expect(changes.first.locator(".chorus-change-letter")).to_have_text("??")
    expect(page.locator("#chorus-diff")).to_contain_text("+Hi from the agent")
    content = page.content()
    assert "'git'" not in content and "&quot;git&quot;" not in content and "{'status'" not in content
    assert page.get_by_text("Changes in the working directory").count() == 1  # once, not twice

    # The take-over command, pasted as printed into a shell that has no venv on its PATH.
    page.goto(f"{portal}/admin/sessions_app/session/{turn.session_id}/change/")
    command = page.locator("#takeover-command").inner_text()
    venv_bin = os.path.dirname(sys.executable)
    shell_env = {k: v for k, v in stack["daemon"].env.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    shell_env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    done = subprocess.run(["bash", "-c", command], input="@reply back in the terminal\n", capture_output=True,
                          text=True, env=shell_env, cwd="/", timeout=60)
    assert done.returncode == 0, (command, done.stderr)
    assert "back in the terminal" in done.stdout and '"resumed":true' in done.stdout


def test_session_page_follows_a_turn_live(stack):
    page, portal = stack["page"], stack["portal"]
    first = start(stack, "@reply first answer")
    wait_turn(first, lambda t: t.status == "ended", "the first turn to end")
    page.goto(f"{portal}/admin/sessions_app/session/{first.session_id}/change/")
    expect(page.locator("#chorus-live-status")).to_have_attribute("data-state", "live", timeout=10_000)
    page.evaluate("window.__chorusMarker = 7")
    status, body = stack["api"].call("POST", f"/sessions/{first.session_id}/messages",
                                     {"prompt": "@sleep 1\n@reply second answer"})
    assert status == 200, body
    row = page.locator(f'#chorus-turn-rows tr[data-turn-id="{body["turn"]}"]')
    expect(row.locator(".chorus-turn-started")).not_to_have_text("–", timeout=20_000)
    expect(row.locator(".chorus-turn-ended")).not_to_have_text("–", timeout=20_000)
    expect(page.locator("#chorus-transcript")).to_contain_text("second answer", timeout=20_000)
    assert page.evaluate("window.__chorusMarker") == 7  # no reload


def test_turn_page_withdraws_interrupt_once_the_stop_is_confirmed(stack):
    page, portal = stack["page"], stack["portal"]
    turn = start(stack, "@sleep 60")
    wait_turn(turn, lambda t: t.status == "running", "the turn to run")
    page.goto(f"{portal}/admin/sessions_app/turn/{turn.pk}/change/")
    expect(page.locator("#chorus-interrupt")).to_be_visible()
    expect(page.locator("#chorus-mark-interrupted")).to_be_visible()
    expect(page.locator("#chorus-live-status")).to_have_attribute("data-state", "live", timeout=10_000)
    status, _ = stack["api"].call("POST", f"/turns/{turn.pk}/interrupt", {"reason": "console test"})
    assert status == 200
    wait_turn(turn, lambda t: t.stop_state == "confirmed", "a confirmed stop", timeout=SIGINT_TIMEOUT_S + 30)
    expect(page.locator("#chorus-interrupt")).to_have_count(0, timeout=15_000)
    expect(page.locator("#chorus-mark-interrupted")).to_have_count(0)


def test_a_completed_task_loses_its_cancel_link_and_its_attempt_keeps_the_session_id(stack):
    page, portal, api = stack["page"], stack["portal"], stack["api"]
    status, issue = api.call("POST", "/issues", {"title": "Cancel link", "body": "b"})
    assert status == 201, issue
    status, body = api.call("POST", "/runs", {
        "issue": issue["id"], "mode": "direct", "target": {"connection": str(stack["connection"].pk)},
        "input": {"prompt": "@sleep 6\n@reply done it\n@outcome succeeded"}})
    assert status == 201, body
    try:
        wait_until(lambda: Attempt.objects.filter(task__node__run_id=body["run"], turn__status="running").exists(),
                   timeout=90, message="the task's turn to run")
    except AssertionError:
        raise AssertionError(_debug(body))
    page.goto(f"{portal}/admin/executions/run/{body['run']}/change/")
    cancel = page.locator("#chorus-task-map a.chorus-task-action", has_text="cancel…")
    expect(cancel).to_have_count(1)
    wait_until(lambda: Run.objects.get(pk=body["run"]).state == "succeeded", timeout=90, message="the run to succeed")
    expect(cancel).to_have_count(0, timeout=15_000)
    attempt = Attempt.objects.select_related("session").get(task__node__run_id=body["run"])
    assert attempt.provider_session_id and attempt.provider_session_id == attempt.session.backend_session_id
    # The outcome's summary is the agent's reply, not the issue's prompt handed to it.
    expect(page.locator("#chorus-evidence")).to_contain_text("done it")
    assert "Issue: Cancel link" not in page.locator("#chorus-evidence").inner_text()


def test_error_pages_are_styled_and_lead_back(stack):
    page, portal = stack["page"], stack["portal"]
    for path, status in (("/admin/no-such-page/", 404), ("/admin/sessions_app/connection/add/", 403)):
        response = page.goto(portal + path)
        assert response.status == status, path
        header = page.evaluate("getComputedStyle(document.getElementById('header')).backgroundColor")
        assert header not in ("", "rgba(0, 0, 0, 0)", "transparent"), (path, header)  # the admin's stylesheet
        page.get_by_role("link", name="Back to the operations console").click()
        page.wait_for_url(f"{portal}/admin/")


def test_a_300000_character_instruction_wraps_inside_the_page(stack):
    page, portal = stack["page"], stack["portal"]
    session = factories.make_session(connection=stack["connection"], cwd=str(stack["workspace"]), title="Long one")
    huge = "y" * 300_000  # one "word": nothing to break at
    turn = factories.make_turn(session=session, prompt=huge, status="ended")
    services.transcript_append(session_id=session.pk, role="user", text=huge, turn_id=turn.pk)
    for path in (f"/admin/sessions_app/session/{session.pk}/change/", f"/admin/sessions_app/turn/{turn.pk}/change/"):
        page.goto(portal + path)
        width, viewport = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert width <= viewport + 2, (path, width, viewport)
        height = page.evaluate("document.documentElement.scrollHeight")
        assert height < 20 * page.evaluate("window.innerHeight"), (path, height)  # collapsed, not 300 k of text


def _debug(body):
    run = Run.objects.get(pk=body["run"])
    return [run.state, run.wait_reason, run.wait_detail, [(n.key, n.state, n.wait_reason, n.wait_detail) for n in run.nodes.all()],
            list(Attempt.objects.filter(task__node__run=run).values("state", "turn__status"))]
