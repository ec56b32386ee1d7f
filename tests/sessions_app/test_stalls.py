"""Stall detection (issue 12 item 1) on the portal's side: thresholds per connection and backend,
the flag with its evidence, clearing when output resumes, the filter and the selector.  The real
daemon and scripted agent are in tests/e2e/test_stall_e2e.py."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from chorus_site.models import Event
from sessions_app import bridge, selectors, stalls
from sessions_app.filters import TurnFilter
from sessions_app.models import BackendSetting, Connection, Turn
from tests.sessions_app.test_sweeps import connection, online, running_turn  # noqa: F401 — fixtures

pytestmark = pytest.mark.django_db

CANARY = "sk-ant-api03-StallCanary000000000000SECRET22222"


def later(turn, seconds: float):
    return timezone.now() + timedelta(seconds=seconds)


def stall_events(turn, kind="turn.stalled"):
    return list(Event.objects.filter(stream=turn.stream, kind=kind, data__id=str(turn.pk)).order_by("id"))


def output(connection, turn, *events):
    bridge._apply_events(connection, turn.pk, [{"kind": kind, "data": data} for kind, data in events])


def test_threshold_is_the_connections_else_the_backends_else_the_site_default(connection, settings):
    settings.CHORUS_STALL_THRESHOLD_S = 600
    assert stalls.stall_threshold_s(connection) == 600
    BackendSetting.objects.create(backend=connection.backend, stall_threshold_s=120)
    assert stalls.stall_threshold_s(connection) == 120
    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=7)
    connection.refresh_from_db()
    assert stalls.stall_threshold_s(connection) == 7


def test_a_silent_running_turn_is_flagged_with_evidence_and_output_clears_it(operator, connection):
    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=30)
    turn = running_turn(operator, connection)
    output(connection, turn, ("tool", {"name": "bash", "input": {"command": f"curl -H 'x-api-key: {CANARY}' x"}}))
    stalls.connection_store_activity(connection_id=connection.pk, activity=[{
        "turn": str(turn.pk), "state": "waiting_on_child", "cpu_percent": 0.0, "silent_s": 31.0,
        "children": [{"pid": 999, "cmdline": f"sleep 3600 --token={CANARY}"}]}])

    assert stalls.turns_sweep_stalled(now=later(turn, 29))["stalled_flagged"] == 0
    assert stalls.turns_sweep_stalled(now=later(turn, 31))["stalled_flagged"] == 1
    turn.refresh_from_db()
    assert turn.status == "running" and turn.stalled_at is not None  # a flag, never a status
    evidence = turn.stall_evidence
    assert evidence["threshold_s"] == 30 and evidence["silent_s"] >= 30
    assert evidence["last_output_at"] and evidence["last_tool_call"]["name"] == "bash"
    assert evidence["process_state"] == "waiting_on_child"
    assert evidence["process"]["children"][0]["cmdline"].startswith("sleep 3600 --token=")
    assert CANARY not in str(evidence) and CANARY not in str(stall_events(turn)[0].data)
    assert [t.pk for t in selectors.turns_stalled()] == [turn.pk]
    assert list(TurnFilter({"stalled": "true"}, Turn.objects.all()).qs) == [turn]
    assert stalls.turns_sweep_stalled(now=later(turn, 60))["stalled_flagged"] == 0  # once
    assert len(stall_events(turn)) == 1

    output(connection, turn, ("progress", {"message": "back"}))
    turn.refresh_from_db()
    assert turn.stalled_at is None and turn.status == "running"
    assert turn.stall_evidence["cleared_by"] == "output"
    [cleared] = stall_events(turn, "turn.unstalled")
    assert cleared.data["stalled"] == "not_stalled" and cleared.data["basis"] == "output"
    assert list(selectors.turns_stalled()) == []
    # The output event is newer than the unstall: the turn's events stay in commit order.
    assert Event.objects.filter(stream=turn.stream, kind="turn.output").order_by("-id").first().id > cleared.id


def test_a_turn_that_leaves_running_is_cleared_by_the_sweep(operator, connection):
    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=5)
    turn = running_turn(operator, connection)
    stalls.turns_sweep_stalled(now=later(turn, 10))
    assert Turn.objects.get(pk=turn.pk).stalled_at is not None
    bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "ended"})
    assert stalls.turns_sweep_stalled(now=later(turn, 11))["stalled_cleared"] == 1
    turn.refresh_from_db()
    assert turn.stalled_at is None and turn.stall_evidence["cleared_by"] == "status"


def test_a_turn_being_stopped_is_not_flagged(operator, connection):
    from sessions_app import actions

    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=5)
    turn = running_turn(operator, connection)
    actions.turn_interrupt(actor=operator, turn_id=turn.pk)
    assert stalls.turns_sweep_stalled(now=later(turn, 10))["stalled_flagged"] == 0


def test_heartbeat_frames_carry_activity_that_is_validated(connection):
    from sessions_app import daemon_schemas

    frame = daemon_schemas.validated(daemon_schemas.HeartbeatFrame, {
        "type": "heartbeat", "running": [], "activity": [{"turn": str(uuid.uuid4()), "state": "silent",
                                                           "children": [], "future_field": 1}]})
    assert frame.activity[0].state == "silent"
    with pytest.raises(Exception):
        daemon_schemas.validated(daemon_schemas.HeartbeatFrame, {
            "type": "heartbeat", "activity": [{"turn": str(uuid.uuid4()), "state": "asleep"}]})


def test_only_ops_admin_sets_a_connections_stall_threshold_in_the_admin_and_it_is_audited(
        connection, operator, ops_admin_user, client):
    from chorus_site.models import AuditEntry

    url = f"/admin/sessions_app/connection/{connection.pk}/change/"
    client.force_login(operator)
    client.post(url, {"stall_threshold_s": "3"})
    connection.refresh_from_db()
    assert connection.stall_threshold_s is None  # an operator only views the connection
    assert 'name="stall_threshold_s"' not in client.get(url).content.decode()

    client.force_login(ops_admin_user)
    assert 'name="stall_threshold_s"' in client.get(url).content.decode()
    response = client.post(url, {"stall_threshold_s": "3"})
    assert response.status_code == 302, response.content.decode()[:2000]
    connection.refresh_from_db()
    assert connection.stall_threshold_s == 3 and connection.name  # nothing else changed
    assert AuditEntry.objects.filter(action="connection.stall_threshold", target=f"connection:{connection.pk}",
                                     outcome="stall_threshold_s=3").exists()
    client.post(url, {"stall_threshold_s": "0"})
    connection.refresh_from_db()
    assert connection.stall_threshold_s == 3  # at least 1 s


def test_the_turn_page_shows_a_stall_with_the_operators_options(operator, connection, client):  # noqa: F811
    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=5)
    turn = running_turn(operator, connection)
    client.force_login(operator)
    url = f"/admin/sessions_app/turn/{turn.pk}/change/"
    assert 'data-stalled="no"' in client.get(url).content.decode()
    stalls.turns_sweep_stalled(now=later(turn, 10))
    page = client.get(url).content.decode()
    assert 'data-stalled="yes"' in page and "chorus-stall-summary" in page
    assert "interrupt it" in page and "chorus-stall-message" in page and "or wait" in page
    listing = client.get("/admin/sessions_app/turn/?stalled=yes").content.decode()
    assert f'data-live-id="{turn.pk}" data-live-field="stalled"' in listing


def test_deleting_backend_settings_from_the_changelist_is_audited(client, ops_admin_user):
    """The changelist's "delete selected" bypasses delete_model: each deleted row is audited too."""
    from chorus_site.models import AuditEntry

    BackendSetting.objects.create(backend="claude_code", stall_threshold_s=120)
    BackendSetting.objects.create(backend="codex", stall_threshold_s=300)
    client.force_login(ops_admin_user)
    response = client.post("/admin/sessions_app/backendsetting/", {
        "action": "delete_selected", "_selected_action": list(BackendSetting.objects.values_list("pk", flat=True)),
        "post": "yes"})
    assert response.status_code == 302
    assert not BackendSetting.objects.exists()
    assert sorted(AuditEntry.objects.filter(action="backend_setting.delete").values_list("target", flat=True)) == [
        "backend:claude_code", "backend:codex"]
