"""/metrics (issue 12 item 3): who may scrape, the state read from the database at scrape time and
counters that move when turns finish, fail and are interrupted.  Through real processes and a
multiprocess directory: tests/e2e/test_metrics_e2e.py."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sessions_app import actions, bridge, stalls
from sessions_app.models import Connection
from tests.sessions_app.test_sweeps import connection, running_turn  # noqa: F401 — fixtures

pytestmark = pytest.mark.django_db

TOKEN = "metrics-test-token-0123456789"


@pytest.fixture
def scrape(client, settings):
    settings.CHORUS_METRICS_TOKEN = TOKEN
    settings.CHORUS_METRICS_ALLOWLIST = []

    def text() -> str:
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert response.status_code == 200, response.content
        return response.content.decode()

    def get() -> dict[tuple, float]:
        return samples(text())

    get.text = text
    return get


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(scraped, name, **labels) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_are_off_without_a_token_or_allowlist(client, settings):
    settings.CHORUS_METRICS_TOKEN = ""
    settings.CHORUS_METRICS_ALLOWLIST = []
    assert client.get("/metrics").status_code == 404


def test_metrics_are_refused_without_the_token_and_served_with_it(client, settings):
    settings.CHORUS_METRICS_TOKEN = TOKEN
    settings.CHORUS_METRICS_ALLOWLIST = []
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": f"Basic {TOKEN}"}):
        response = client.get("/metrics", **headers)
        assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
        assert b"chorus_" not in response.content
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


def test_an_allowlisted_address_needs_no_token(client, settings):
    settings.CHORUS_METRICS_TOKEN = TOKEN
    settings.CHORUS_METRICS_ALLOWLIST = ["10.0.0.0/8"]
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="192.168.1.1").status_code == 401


@pytest.mark.parametrize("forwarded", [{"HTTP_X_FORWARDED_FOR": "203.0.113.9"}, {"HTTP_X_FORWARDED_PROTO": "https"},
                                       {"HTTP_FORWARDED": "for=203.0.113.9"}, {"HTTP_X_REAL_IP": "203.0.113.9"}])
def test_a_request_through_a_proxy_is_never_admitted_by_address(client, settings, forwarded):
    """The documented deployment puts daphne on 127.0.0.1 behind a TLS proxy: every request through
    the proxy arrives from the proxy's address, so an allowlisted loopback would let anyone on the
    internet read /metrics. What came through a proxy needs the token."""
    settings.CHORUS_METRICS_TOKEN = TOKEN
    settings.CHORUS_METRICS_ALLOWLIST = ["127.0.0.1"]
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200  # a scraper on the host
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1", **forwarded).status_code == 401
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_AUTHORIZATION=f"Bearer {TOKEN}",
                      **forwarded).status_code == 200


def test_state_is_read_at_scrape_time_and_counters_move(operator, connection, scrape, django_capture_on_commit_callbacks):  # noqa: F811
    before = scrape()
    with django_capture_on_commit_callbacks(execute=True):
        turn = running_turn(operator, connection)
    scraped = scrape()
    assert value(scraped, "chorus_turns", status="running", backend="scripted") == 1
    assert value(scraped, "chorus_connections", status="online", backend="scripted") >= 1
    assert value(scraped, "chorus_connection_heartbeat_age_seconds", connection=connection.name, status="online") >= 0

    Connection.objects.filter(pk=connection.pk).update(stall_threshold_s=1)
    from datetime import timedelta

    from django.utils import timezone

    with django_capture_on_commit_callbacks(execute=True):
        stalls.turns_sweep_stalled(now=timezone.now() + timedelta(seconds=5))
    scraped = scrape()
    assert value(scraped, "chorus_turns_stalled", backend="scripted") == 1
    assert value(scraped, "chorus_turn_stalls_total", backend="scripted") == \
        value(before, "chorus_turn_stalls_total", backend="scripted") + 1

    with django_capture_on_commit_callbacks(execute=True):
        bridge._apply_advance(connection, turn.pk, {
            "report_id": str(uuid.uuid4()), "status": "interrupted", "reason": "crash",
            "wake_error": {"kind": "auth", "summary": "not logged in"}})
    after = scrape()
    finished = ("chorus_turns_finished_total", dict(status="interrupted", reason="crash", backend="scripted"))
    assert value(after, finished[0], **finished[1]) == value(before, finished[0], **finished[1]) + 1
    assert value(after, "chorus_wake_errors_total", kind="auth", backend="scripted") == \
        value(before, "chorus_wake_errors_total", kind="auth", backend="scripted") + 1
    assert value(after, "chorus_turns", status="running", backend="scripted") == 0
    assert value(after, "chorus_turns_stalled", backend="scripted") == 0


def test_an_interrupt_confirmed_is_counted_with_its_time(operator, connection, scrape, django_capture_on_commit_callbacks):  # noqa: F811
    turn = running_turn(operator, connection)
    before = scrape()
    with django_capture_on_commit_callbacks(execute=True):
        actions.turn_interrupt(actor=operator, turn_id=turn.pk)
        bridge._apply_advance(connection, turn.pk, {"report_id": str(uuid.uuid4()), "status": "interrupted",
                                                     "reason": "user", "stop_state": "confirmed"})
    after = scrape()
    assert value(after, "chorus_interrupts_total", outcome="confirmed") == \
        value(before, "chorus_interrupts_total", outcome="confirmed") + 1
    assert value(after, "chorus_interrupt_confirm_seconds_count") == \
        value(before, "chorus_interrupt_confirm_seconds_count") + 1


def test_the_grafana_example_uses_only_metrics_the_portal_exposes(operator, connection, scrape, django_capture_on_commit_callbacks):  # noqa: F811
    import json
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    from chorus_site import metrics

    with django_capture_on_commit_callbacks(execute=True):
        running_turn(operator, connection)
    # Labelled series appear once used; touch one of each so that every family shows its names.
    for name, labels in [("TURNS_FINISHED", 3), ("WAKE_ERRORS", 2), ("INTERRUPTS", 1), ("STALLS", 1),
                         ("COMMAND_DELIVERY_SECONDS", 1), ("CELERY_TASK_SECONDS", 2),
                         ("CELERY_TASK_QUEUE_SECONDS", 1), ("LIVE_CLIENTS", 1)]:
        getattr(metrics, name).labels(*["probe"] * labels)
    exposed = exposed_names(scrape.text()) | exposed_names(generate_latest().decode())
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\bchorus_[a-z_]+", target["expr"])}
    assert used and used <= exposed, sorted(used - exposed)


def exposed_names(text: str) -> set[str]:
    """Family names (a gauge with no rows yet still declares itself) and sample names (_bucket, _total)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names
