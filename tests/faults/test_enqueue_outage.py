"""Issue 7, item 7 (commit-then-enqueue): with Redis down, ``POST /runs`` and ``POST /turns/{id}/interrupt``
answered 500 although their change had committed, and the run then never ticked.

Here the portal's Redis (Celery broker and channel layer) is a ``redis-server`` of the test's own,
killed before the requests.  Each action must answer with what it committed, and what its lost
message would have done must be found again from the database by the periodic sweeps.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from channels.layers import channel_layers
from django.test import Client
from django.utils import timezone

from chorus_site.celery import app
from chorus_site.models import AuditEntry
from executions.models import Run
from executions.recovery import runs_needing_a_tick
from sessions_app import actions
from sessions_app.models import Connection, Turn
from tests import factories

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.postgres]


@pytest.fixture
def redis_down(own_redis, monkeypatch, settings):
    """This process's broker and channel layer on ``own_redis``, which is then killed."""
    def reset_pools():
        app._pool = None
        app.amqp._producer_pool = None
        channel_layers.backends.clear()

    monkeypatch.setitem(app.conf, "broker_url", own_redis.url)
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [own_redis.url]}}}
    reset_pools()
    own_redis.kill()
    yield own_redis
    monkeypatch.undo()
    reset_pools()


def post(client, url, body=None):
    return client.post(url, data=json.dumps(body or {}), content_type="application/json")


@pytest.fixture
def connection():
    connection = factories.make_connection(cwds=["/srv/work"], sigint_timeout_s=2)
    Connection.objects.filter(pk=connection.pk).update(status="online", last_heartbeat_at=timezone.now())
    key = connection.plain_key
    connection = Connection.objects.get(pk=connection.pk)
    connection.plain_key = key
    return connection


def test_actions_commit_then_enqueue_and_answer_during_a_redis_outage(operator, connection, redis_down):
    client = Client()
    client.force_login(operator)
    started = actions.session_start(actor=operator, connection_id=connection.pk, cwd="/srv/work", prompt="@sleep 60")
    turn = Turn.objects.get(pk=started["turn"])
    running = Client().post(f"/api/v1/daemon/turns/{turn.pk}/advance", content_type="application/json",
                            data=json.dumps({"report_id": str(uuid.uuid4()), "status": "running", "pid": 4242}),
                            HTTP_AUTHORIZATION=f"Bearer {connection.plain_key}")
    assert running.status_code == 200, running.content

    issue = factories.make_issue()
    answer = post(client, "/api/v1/runs", {"issue": str(issue.pk), "mode": "direct",
                                           "input": {"prompt": "@outcome succeeded"},
                                           "target": {"connection": str(connection.pk)}})
    assert answer.status_code == 201, answer.content
    run = Run.objects.get(pk=answer.json()["run"])
    assert run.state == answer.json()["state"] == "running"

    stopped = post(client, f"/api/v1/turns/{turn.pk}/interrupt", {"reason": "wrong branch"})
    assert stopped.status_code == 200, stopped.content
    assert stopped.json()["changed"] is True and stopped.json()["stop_state"] == "requested"
    turn.refresh_from_db()
    assert turn.stop_state == "requested"
    assert AuditEntry.objects.filter(action="turn.interrupt", target=f"turn:{turn.pk}").count() == 1

    # Their messages (the run's first tick, the stop's deadline) never reached a broker; the sweeps find both.
    assert str(run.pk) in runs_needing_a_tick()
    assert actions.stops_settle_overdue(now=turn.stop_deadline_at + timedelta(seconds=1)) == 1
    assert Turn.objects.get(pk=turn.pk).stop_state == "unconfirmed"
