"""The admin index dashboard (issue 11 item 1) and readable times (item 3), without a browser.

The live side (counts changing as events arrive, rows appearing, timers ticking) is proved in a real
browser by tests/e2e/test_admin_dashboard_live.py.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chorus_site import dashboard, times
from sessions_app.models import Connection, Turn
from tests import factories

pytestmark = pytest.mark.django_db



def listed(page: str, model_path: str) -> list[str]:
    """Ids of the rows of a changelist page, in order (each row links its change page)."""
    body = page.split('id="result_list"', 1)[1] if 'id="result_list"' in page else ""
    return list(dict.fromkeys(re.findall(rf'href="/admin/{model_path}/([0-9a-f-]{{36}})/change/', body)))


def _login(client, user):
    client.force_login(user)
    return client


def _attention(client) -> dict:
    response = client.get("/admin/dashboard/summary.json")
    assert response.status_code == 200
    return {item["key"]: item for item in response.json()["attention"]}


def _make_attention_rows():
    """One of each thing that needs an operator, plus rows that must not be counted."""
    now = timezone.now()
    online = factories.make_connection(status="online")
    Connection.objects.filter(pk=online.pk).update(last_heartbeat_at=now)
    offline = factories.make_connection(status="offline")
    on_online = factories.make_session(connection=online)
    on_offline = factories.make_session(connection=offline)
    rows = {
        "turns_stuck": [factories.make_turn(session=on_offline, status="running", connection=offline).pk,
                        factories.make_turn(session=factories.make_session(connection=online), status="running",
                                            connection=online, stalled_at=now - timedelta(minutes=11)).pk],
        "turns_failed_24h": [factories.make_turn(session=on_online, status="interrupted", interrupted_reason="crash",
                                                 connection=online, ended_at=now - timedelta(hours=1)).pk],
        "turns_stop_unconfirmed": [factories.make_turn(session=factories.make_session(connection=online),
                                                       status="running", connection=online,
                                                       stop_state="unconfirmed").pk],
        "turns_waiting": [factories.make_turn(session=factories.make_session(connection=online),
                                              status="requires_action", connection=online).pk],
    }
    # Not counted: a healthy running turn, an operator's interrupt, a failure older than 24 h.
    factories.make_turn(session=factories.make_session(connection=online), status="running", connection=online)
    factories.make_turn(session=factories.make_session(connection=online), status="interrupted",
                        interrupted_reason="user", ended_at=now, connection=online)
    factories.make_turn(session=factories.make_session(connection=online), status="interrupted",
                        interrupted_reason="crash", ended_at=now - timedelta(days=2), connection=online)
    failed = factories.make_run(state="failed", completed_at=now - timedelta(minutes=5))
    factories.make_run(state="failed", completed_at=now - timedelta(days=3))
    factories.make_run(state="succeeded", completed_at=now)
    rows["runs_failed_24h"] = [failed.pk]
    rows["approvals_waiting"] = [factories.make_approval(node=factories.make_node()).pk]
    factories.make_approval(node=factories.make_node(), status="approved")
    rows["reviews_waiting"] = [factories.make_issue(status="in_review").pk]
    rows["connections_down"] = [offline.pk]
    return rows


def test_each_count_links_to_a_list_of_exactly_the_counted_rows(client, ops_admin_user):
    expected = _make_attention_rows()
    _login(client, ops_admin_user)
    attention = _attention(client)
    assert {key: item["count"] for key, item in attention.items()} == {key: len(rows) for key, rows in expected.items()}
    for key, model_path in [("turns_stuck", "sessions_app/turn"), ("turns_failed_24h", "sessions_app/turn"),
                            ("turns_stop_unconfirmed", "sessions_app/turn"), ("turns_waiting", "sessions_app/turn"),
                            ("runs_failed_24h", "executions/run"), ("connections_down", "sessions_app/connection")]:
        page = client.get(attention[key]["url"])
        assert page.status_code == 200, key
        assert sorted(listed(page.content.decode(), model_path)) == sorted(str(pk) for pk in expected[key]), key


def test_the_index_renders_the_dashboard_for_ops_roles_only(client, operator, outsider):
    factories.make_turn(status="running")
    _login(client, outsider)
    assert "chorus-dashboard" not in client.get("/admin/").content.decode()
    assert client.get("/admin/dashboard/summary.json").status_code == 403
    client.logout()
    _login(client, operator)
    page = client.get("/admin/").content.decode()
    assert 'id="chorus-dashboard"' in page and "Needs attention" in page
    assert 'data-dash-count="turns_stuck"' in page
    assert "chorus/vendor/chart.umd.min.js" in page and "<script>" not in page  # CSP: no inline script
    assert 'id="chorus-chart-runs-empty">none in the last 24 h' in page  # no run: said so, not an empty axis
    assert 'id="chorus-chart-turns-empty" hidden>' in page
    # Deciding is an operator's action: their approval and review counts lead to the inbox.
    attention = _attention(client)
    assert attention["approvals_waiting"]["url"] == "/admin/executions/issue/inbox/"


def test_viewer_links_go_to_the_lists_it_may_read(client, viewer):
    _login(client, viewer)
    attention = _attention(client)
    assert attention["approvals_waiting"]["url"].startswith("/admin/executions/approval/")
    assert attention["reviews_waiting"]["url"].startswith("/admin/executions/issue/?")


def _bulk_rows(count: int):
    """``count`` turns, runs, connections and audit entries spread over states and the last day."""
    from chorus_site.models import AuditEntry
    from executions.models import Issue, Run

    now = timezone.now()
    issue = factories.make_issue()
    conns = [factories.make_connection(status=("online", "offline", "draining")[i % 3]) for i in range(3)]
    sessions = [factories.make_session(connection=conns[i % 3]) for i in range(3)]
    statuses = ["running", "ended", "interrupted", "requires_action", "pending"]
    existing = Turn.objects.count()
    Turn.objects.bulk_create([
        Turn(session=sessions[i % 3], seq=1000 + existing + i, trigger="human_instruction", status=statuses[i % 5],
             interrupted_reason="crash" if statuses[i % 5] == "interrupted" else "",
             stop_state="unconfirmed" if i % 10 else "none", connection=conns[i % 3],
             ended_at=now - timedelta(minutes=i) if statuses[i % 5] in {"ended", "interrupted"} else None)
        for i in range(count)])
    Run.objects.bulk_create([Run(issue=issue, mode="direct", state=("failed", "running", "succeeded")[i % 3],
                                 completed_at=now - timedelta(minutes=i)) for i in range(count)])
    Issue.objects.bulk_create([Issue(title=f"review {i}", status="in_review") for i in range(count // 10)])
    AuditEntry.objects.bulk_create([AuditEntry(actor="op", action="turn.interrupt", target=f"turn:{i}",
                                               client="admin", outcome="stop requested") for i in range(count)])


@pytest.mark.parametrize("url", ["/admin/", "/admin/dashboard/summary.json"])
def test_query_count_does_not_grow_with_the_rows(client, ops_admin_user, url):
    _login(client, ops_admin_user)
    _bulk_rows(10)
    client.get(url)  # warm the session and permission caches as a second request would
    with CaptureQueriesContext(connection) as small:
        assert client.get(url).status_code == 200
    _bulk_rows(1500)
    with CaptureQueriesContext(connection) as large:
        response = client.get(url)
    assert response.status_code == 200
    assert len(large) == len(small) <= 12, [q["sql"][:120] for q in large]
    if url.endswith(".json"):
        attention = {item["key"]: item for item in response.json()["attention"]}
        assert attention["turns_stop_unconfirmed"]["capped"] and attention["turns_stop_unconfirmed"]["count"] == 999
        assert len(response.json()["audit"]) == dashboard.AUDIT_SHOWN


def test_charts_count_the_last_day_by_hour_and_state(ops_admin_user):
    now = timezone.now()
    factories.make_turn(status="running")
    factories.make_turn(status="ended")
    old = factories.make_turn(status="ended")
    Turn.objects.filter(pk=old.pk).update(created_at=now - timedelta(days=2))  # id says today: created_at decides
    chart = dashboard.summary(ops_admin_user, now=now + timedelta(seconds=1))["charts"]["turns"]
    assert len(chart["hours"]) == dashboard.CHART_HOURS
    assert {s["state"]: sum(s["values"]) for s in chart["series"]} == {"running": 1, "ended": 1}
    assert {s["state"]: s["values"][-1] for s in chart["series"]} == {"running": 1, "ended": 1}


# ---------------------------------------------------------------- readable times
@pytest.mark.parametrize("seconds, text", [(0.25, "250 ms"), (14, "14 s"), (134, "2 m 14 s"), (3900, "1 h 05 m"),
                                           (3 * 86400 + 4 * 3600, "3 d 4 h")])
def test_durations_read_as_people_say_them(seconds, text):
    assert times.format_duration(seconds) == text


def test_relative_times_and_the_absolute_one_on_hover():
    now = datetime(2026, 12, 1, 12, 0, tzinfo=dt_timezone.utc)
    assert times.format_relative(now - timedelta(minutes=3, seconds=20), now) == "3 min ago"
    assert times.format_relative(now - timedelta(seconds=2), now) == "just now"
    assert times.format_relative(now + timedelta(minutes=5), now) == "in 5 min"
    html = times.when_html(now - timedelta(hours=5), now)
    assert html == ('<time class="chorus-when" datetime="2026-12-01T07:00:00.000Z" '
                    'title="2026-12-01 07:00:00 UTC">5 h ago</time>')
    timer = times.duration_html(now - timedelta(seconds=134), None, now)
    assert 'class="chorus-timer"' in timer and "running for 2 m 14 s" in timer


def test_lists_show_relative_times_and_durations(client, viewer):
    started = timezone.now() - timedelta(minutes=10)
    factories.make_turn(status="ended", started_at=started, ended_at=started + timedelta(seconds=134))
    factories.make_turn(status="running", started_at=started)
    _login(client, viewer)
    page = client.get("/admin/sessions_app/turn/").content.decode()
    assert "<th" in page and "duration" in page.lower()
    assert '<span class="chorus-duration"' in page and ">2 m 14 s</span>" in page
    assert '<time class="chorus-timer"' in page and "running for 10 m" in page
    assert "10 min ago" in page and 'title="' + started.astimezone(dt_timezone.utc).strftime("%Y-%m-%d %H:%M") in page


def test_detail_pages_read_times_and_durations(client, viewer):
    started = timezone.now() - timedelta(minutes=10)
    turn = factories.make_turn(status="ended", started_at=started, ended_at=started + timedelta(seconds=134))
    _login(client, viewer)
    page = client.get(f"/admin/sessions_app/turn/{turn.pk}/change/").content.decode()
    assert "10 min ago" in page and ">2 m 14 s</span>" in page  # started, and the duration after ended
    assert page.count('<time class="chorus-when"') >= 3  # created, started, ended (and the timeline's)


def test_the_run_page_shows_each_attempts_duration(client, viewer):
    started = timezone.now() - timedelta(minutes=5)
    run, _node, _task, attempt = factories.make_run_graph(run_state="running", attempt_state="running")
    factories.make_attempt(task=_task, state="failed", started_at=started, ended_at=started + timedelta(seconds=134))
    from executions.models import Attempt

    Attempt.objects.filter(pk=attempt.pk).update(started_at=started)
    _login(client, viewer)
    page = client.get(f"/admin/executions/run/{run.pk}/change/").content.decode()
    task_map = page.split('id="chorus-task-map"', 1)[1]
    assert ">2 m 14 s</span>" in task_map  # the failed attempt took 2 m 14 s
    assert '<time class="chorus-timer"' in task_map and "running for 5 m" in task_map  # the running one ticks


def test_a_page_that_may_change_its_record_also_reads_times(client, ops_admin_user):
    """ops_admin may change API tokens: the form then lists the read-only time columns too, and
    must take them as the same ones each time it asks (a 500 before)."""
    from chorus_site.tokens import token_create

    token, _raw = token_create(user=ops_admin_user, name="dash")
    _login(client, ops_admin_user)
    response = client.get(f"/admin/chorus_site/apitoken/{token.pk}/change/")
    assert response.status_code == 200
    assert '<time class="chorus-when"' in response.content.decode()


def test_recent_actions_name_their_targets_by_the_distinguishing_tail(client, operator):
    from chorus_site.audit import audit_record

    turn = factories.make_turn()
    audit_record(actor=operator, action="turn.interrupt", target=f"turn:{turn.pk}", outcome="stop requested",
                 client="admin")
    _login(client, operator)
    entry = client.get("/admin/dashboard/summary.json").json()["audit"][0]
    assert entry["target_label"] == f"turn …{str(turn.pk)[-8:]}"
    assert entry["target_url"] == f"/admin/sessions_app/turn/{turn.pk}/change/"
    page = client.get("/admin/").content.decode()
    assert f'title="turn:{turn.pk}"' in page and f">turn …{str(turn.pk)[-8:]}</a>" in page
