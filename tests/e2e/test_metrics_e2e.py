"""/metrics scraped from a real portal while real turns run, fail and are interrupted (issue 12
item 3): a daphne portal and a Celery worker with beat share one PROMETHEUS_MULTIPROC_DIR, the
daemon spawns the scripted agent; the counters move, the state gauges follow, no token → 401."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from tests.chorus_site.test_metrics import samples, value
from tests.e2e.conftest import wait_until
from tests.e2e.test_bridge_e2e import start, wait_status

pytestmark = [pytest.mark.django_db(transaction=True)]

TOKEN = "e2e-metrics-token-abcdef0123456789"


@pytest.fixture
def metrics_env(monkeypatch, tmp_path):
    """Set before the portal and the worker start (they inherit the environment)."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    monkeypatch.setenv("CHORUS_METRICS_TOKEN", TOKEN)
    return directory


def scrape(portal: str, token: str | None = TOKEN) -> dict:
    request = urllib.request.Request(portal + "/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return samples(response.read().decode())


def test_counters_move_as_turns_run_fail_and_are_interrupted(metrics_env, bridge):
    portal = bridge["portal"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape(portal, token=None)
    assert refused.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape(portal, token="not-the-token")
    assert refused.value.code == 401

    before = scrape(portal)
    ended = start(bridge, "@reply fine", idea_key="idea:metrics-ok")
    failed = start(bridge, "@stderr broken\n@exit 3", idea_key="idea:metrics-fail", acknowledge_changes=True)
    stopped = start(bridge, "@sleep 60", idea_key="idea:metrics-stop")
    wait_status(ended, "ended")
    wait_status(failed, "interrupted")
    wait_status(stopped, "running")
    during = scrape(portal)
    assert value(during, "chorus_turns", status="running", backend="scripted") == 1
    status, _ = bridge["api"].call("POST", f"/turns/{stopped.pk}/interrupt", {"reason": "metrics e2e"})
    assert status == 200
    wait_until(lambda: wait_status(stopped, "interrupted").stop_state == "confirmed", timeout=40,
               message="a confirmed stop")

    def moved(name, **labels):
        return value(scrape(portal), name, **labels) - value(before, name, **labels)

    # Counted after commit in whichever process applied the report: wait for the scrape to show it.
    wait_until(lambda: moved("chorus_interrupts_total", outcome="confirmed") == 1, timeout=20,
               message="the interrupt counted")
    after = scrape(portal)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("chorus_turns_finished_total", status="ended", reason="", backend="scripted") == 1
    assert delta("chorus_turns_finished_total", status="interrupted", reason="crash", backend="scripted") == 1
    assert delta("chorus_turns_finished_total", status="interrupted", reason="user", backend="scripted") == 1
    assert delta("chorus_wake_errors_total", kind="exited_nonzero", backend="scripted") == 1
    assert delta("chorus_interrupt_confirm_seconds_count") == 1
    assert delta("chorus_command_delivery_seconds_count", action="start_turn") == 3
    assert delta("chorus_agent_events_ingested_total") > 0
    assert value(after, "chorus_turns", status="running", backend="scripted") == 0
    assert value(after, "chorus_live_clients", kind="daemon") == 1
    assert value(after, "chorus_connections", status="online", backend="scripted") == 1
    # The beat's sweeps run in the worker process (every 5 s): their latency reaches the same scrape.
    wait_until(lambda: value(scrape(portal), "chorus_celery_task_seconds_count",
                             task="sessions_app.tasks.connections_sweep", outcome="success") > 0,
               timeout=30, message="a sweep's run time")
    assert value(scrape(portal), "chorus_celery_task_queue_seconds_count", task="sessions_app.tasks.connections_sweep") > 0
