"""Issue 11, "Broken or misleading now", the parts a page or a record shows without a browser:
ids that tell runs apart, actions labelled by what they do, search by the agent's session id,
hand-off context quoted, readable records, a reason for every state, consistent demo data."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from executions.models import Issue, Run, RunNode
from sessions_app import actions, selectors, services
from sessions_app.models import Connection, Turn
from tests import factories

pytestmark = pytest.mark.django_db


def client_for(user):
    user.refresh_from_db()
    client = Client()
    client.force_login(user)
    return client


def test_ids_are_shown_by_their_random_tail():
    issue = factories.make_issue(title="Tails")
    runs = [factories.make_run(issue=issue) for _ in range(10)]
    assert len({str(run) for run in runs}) == 10
    assert all(str(run.pk)[:8] not in str(run) for run in runs)
    turn = factories.make_turn(session=factories.make_session(title="Named"))
    assert str(Turn.objects.select_related("session").get(pk=turn.pk)) == "turn 1 of Named"
    assert str(turn.session_id) not in str(Turn.objects.get(pk=turn.pk))  # no join: the tail only


def test_run_cancel_page_labels_each_button_by_what_it_does(operator):
    run = factories.make_run(state="running")
    page = client_for(operator).get(reverse("admin:executions_run_cancel", args=[run.pk])).content.decode()
    assert 'value="Cancel run"' in page
    assert ">Back, change nothing</a>" in page
    assert page.count(">Cancel<") == 0 and 'value="Cancel"' not in page


def test_sessions_are_found_by_the_agents_session_id_the_page_shows(viewer):
    agent_id = str(uuid.uuid4())  # Claude Code's ids are UUIDs: the UUID path must not hide them
    session = factories.make_session(title="Found by agent id", backend_session_id=agent_id)
    factories.make_session(title="Another one")
    page = client_for(viewer).get("/admin/sessions_app/session/", {"q": agent_id}).content.decode()
    assert "Found by agent id" in page and "Another one" not in page
    assert session.pk  # and the portal id still finds it
    page = client_for(viewer).get("/admin/sessions_app/session/", {"q": str(session.pk)}).content.decode()
    assert "Found by agent id" in page


def test_a_handoff_quotes_the_failed_turn_as_context_not_instructions():
    session = factories.make_session(title="Crashed")
    turn = factories.make_turn(session=session, prompt="build it\n@exit 3", status="interrupted",
                               interrupted_reason="crash", changes={"git": True, "status": [" M app.py"]})
    services.transcript_append(session_id=session.pk, role="user", text="build it\n@exit 3", turn_id=turn.pk)
    prompt = actions.handoff_prompt(session, "Please finish the build")
    from agents.scripted_agent import parse_prompt

    directives, message = parse_prompt(prompt)
    assert directives == []  # nothing of the earlier attempt runs again
    assert "~~~text" in prompt and "> @exit 3" in prompt and "quoted as context only" in prompt
    assert "> M app.py" in prompt and "{'git'" not in prompt
    assert "Operator's context: Please finish the build" in message


def test_markdown_record_has_no_literal_escaped_newlines(viewer):
    run, node, task, attempt = factories.make_run_graph(run_state="running")
    Run.objects.filter(pk=run.pk).update(wait_detail={"unblock": "line one\nline two"})
    attempt.outcome = {"intent": "failed", "summary": "first line\nsecond line"}
    attempt.save(update_fields=["outcome"])
    text = client_for(viewer).get(reverse("admin:executions_run_troubleshooting_md", args=[run.pk])).content.decode()
    assert "\\n" not in text
    assert "summary: first line second line" in text


def test_each_state_an_operator_sees_has_its_reason(viewer):
    crashed = factories.make_session(title="Crashed session")
    factories.make_turn(session=crashed, status="interrupted", interrupted_reason="crash")
    page = client_for(viewer).get("/admin/sessions_app/session/").content.decode()
    assert "needs attention" in page and "turn #1 was interrupted (crash)" in page
    page = client_for(viewer).get(reverse("admin:sessions_app_session_change", args=[crashed.pk])).content.decode()
    assert "needs attention" in page and "resume or hand off" in page

    offline = factories.make_connection(name="gone-host", status="offline")
    pending = factories.make_turn(session=factories.make_session(connection=offline))
    page = client_for(viewer).get(reverse("admin:sessions_app_turn_change", args=[pending.pk])).content.decode()
    assert "Not started yet: connection gone-host is offline" in page

    live = factories.make_connection(name="live-host")
    Connection.objects.filter(pk=live.pk).update(status="online", last_heartbeat_at=timezone.now())
    busy = factories.make_session(connection=live)
    factories.make_turn(session=busy, status="running")
    queued = factories.make_turn(session=busy)
    assert selectors.pending_reason(Turn.objects.get(pk=queued.pk)) == "queued behind turn #1 of the session"

    run = factories.make_run(state="waiting", wait_reason="host_offline",
                             wait_detail={"unblock": "restore the daemon"})
    page = client_for(viewer).get("/admin/executions/run/").content.decode()
    assert "host offline: restore the daemon" in page
    page = client_for(viewer).get(reverse("admin:executions_run_change", args=[run.pk])).content.decode()
    assert "waiting for <strong>host offline: restore the daemon</strong>" in page


def test_turn_changes_are_a_file_list_and_a_diff(viewer):
    turn = factories.make_turn(status="ended", changes={
        "git": True, "status": [" M README.md", "?? new.txt", "D  old.txt"], "diff_stat": "3 files changed",
        "diff": "diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-old\n+new\n"})
    page = client_for(viewer).get(reverse("admin:sessions_app_turn_change", args=[turn.pk])).content.decode()
    assert page.count("Changes in the working directory") == 1
    assert 'title="modified">M</code> <code>README.md' in page
    assert 'title="untracked (new)">??</code> <code>new.txt' in page
    assert 'title="deleted">D</code> <code>old.txt' in page
    assert '<span class="chorus-diff-add">+new</span>' in page
    assert "&#x27;git&#x27;" not in page and "{&#x27;" not in page


def test_demo_data_is_internally_consistent(settings, tmp_path):
    from executions.tasks import runs_tick_waiting

    settings.DATA_DIR = str(tmp_path)
    call_command("chorus_demo", "--quiet-logins", stdout=io.StringIO())
    assert (tmp_path / "demo-workspace" / ".git").is_dir()  # its own repository: changes show
    for issue in Issue.objects.all():
        if issue.runs.exclude(state__in=["succeeded", "failed", "cancelled", "partial_succeeded"]).exists():
            assert issue.status == "in_progress", (issue.title, issue.status)
    runs_tick_waiting.apply()  # what the engine's periodic tick makes of them
    for run in Run.objects.filter(state="waiting"):
        assert run.wait_reason, run.pk
    for node in RunNode.objects.filter(state="waiting"):
        assert node.wait_reason, node.key


def test_redaction_does_not_rescan_long_runs_of_word_characters():
    """A 300,000-character token pasted as an instruction was redacted in minutes: a leading lazy
    "[\\w.-]{0,50}?" (doubled in five gitleaks rules) and the unbounded name of our own
    NAME=value rule made every position rescan the run. The figure is bench/redact_long_text.py's;
    here, that the shapes are gone and the rules still mask."""
    from agents import redaction_rules as rules
    from chorus_site.redaction import redact

    lazy = ("[\\w.-]{0,50}?", "(?i)[\\w.-]{0,50}?")
    assert not [rule_id for rule_id, pattern, *_ in rules._GITLEAKS if pattern.pattern.startswith(lazy)]
    assert "*" not in rules._SECRET_NAME
    key = "Zq8vT2mK9xW4rB7nY1cL5hJ3gF6dS0aP2eU8iO4k"  # 40 characters, as cohere's rule wants
    assert key not in redact(f"export COHERE_API_KEY={key}")
    assert "hunter2-hunter2" not in redact("deploy_" + "x" * 40 + "_PASSWORD=hunter2-hunter2")
