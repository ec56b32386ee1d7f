"""A portal process holds at most DATABASE_POOL_MAX_SIZE server connections (issue 9 item 5).

Without a pool every request in flight held a connection of its own (each ASGI request runs in a
thread of its own), so a burst on one process took as many of PostgreSQL's max_connections as it
had requests waiting; 10 processes could exhaust the server. The portal's connections are told
apart by their application name (libpq's PGAPPNAME).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import psycopg
import pytest
from django.utils import timezone

from chorus_site.tokens import token_create
from tests import factories
from tests.e2e.conftest import portal_server  # noqa: F401  (the fixture, used by name)
from tests.e2e.conftest import test_database_url as database_url_of_tests
from tests.e2e.conftest import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.postgres]

POOL_MAX = 2
BURST = 40
APP_NAME = "chorus-pool-test-portal"


class ConnectionSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self.halt = threading.Event()

    def run(self):
        with psycopg.connect(database_url_of_tests(), autocommit=True, application_name="chorus-pool-sampler") as conn:
            while not self.halt.wait(0.01):
                count = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                                     [APP_NAME]).fetchone()[0]
                self.peak = max(self.peak, count)


def test_a_burst_of_requests_holds_at_most_the_pool(monkeypatch, request, viewer):
    for _ in range(60):
        factories.make_session()
    monkeypatch.setenv("DATABASE_POOL_MAX_SIZE", str(POOL_MAX))
    monkeypatch.setenv("PGAPPNAME", APP_NAME)  # read by libpq when the portal connects
    portal = request.getfixturevalue("portal_server")
    _token, raw = token_create(user=viewer, name="pool")

    def get(_):
        req = urllib.request.Request(portal + "/api/v1/sessions?limit=60", headers={"Authorization": f"Bearer {raw}"})
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status

    sampler = ConnectionSampler()
    sampler.start()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            statuses = list(pool.map(get, range(BURST)))
    finally:
        sampler.halt.set()
        sampler.join(timeout=5)
    assert statuses == [200] * BURST
    assert 1 <= sampler.peak <= POOL_MAX, f"the portal held {sampler.peak} connections at once"


def test_a_request_that_waits_out_the_pool_is_told_to_retry(monkeypatch, request, viewer):
    """Overloaded (every pooled connection taken for DATABASE_POOL_TIMEOUT_S): 503 busy with
    Retry-After, not a 500. The one connection is kept busy by a request blocked on a table lock
    the test holds."""
    monkeypatch.setenv("DATABASE_POOL_MAX_SIZE", "1")
    monkeypatch.setenv("DATABASE_POOL_TIMEOUT_S", "1")
    monkeypatch.setenv("PGAPPNAME", APP_NAME)
    portal = request.getfixturevalue("portal_server")
    _token, raw = token_create(user=viewer, name="busy")

    def get():
        req = urllib.request.Request(portal + "/api/v1/sessions", headers={"Authorization": f"Bearer {raw}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    with psycopg.connect(database_url_of_tests(), application_name="chorus-pool-locker") as locker:
        locker.execute("LOCK TABLE chorus_site_apitoken IN ACCESS EXCLUSIVE MODE")
        with ThreadPoolExecutor(1) as pool:
            blocked = pool.submit(get)
            with psycopg.connect(database_url_of_tests(), autocommit=True) as watch:
                wait_until(lambda: watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                    [APP_NAME]).fetchone()[0] == 1, timeout=30, message="a portal request to wait on the lock")
            status, headers, body = get()  # no connection left in the portal's pool
            locker.rollback()  # the blocked request goes on
            assert blocked.result(timeout=60)[0] == 200
    assert status == 503, body
    assert headers.get("Retry-After") == "1"
    assert json.loads(body)["error"]["code"] == "busy"


def test_open_sse_streams_hold_no_pooled_connection(monkeypatch, request, viewer):
    """An SSE stream lives for minutes; if it kept the connection its access re-check used, a few
    open streams would take the whole pool and every other request of the process would wait it
    out (503 busy). Five streams (one token each) on a pool of two: once every stream has re-checked
    its token, an ordinary list request is still served."""
    from chorus_site.models import ApiToken

    monkeypatch.setenv("DATABASE_POOL_MAX_SIZE", str(POOL_MAX))
    monkeypatch.setenv("DATABASE_POOL_TIMEOUT_S", "3")
    monkeypatch.setenv("CHORUS_ACCESS_RECHECK_S", "1")  # the re-check runs while the streams are open
    monkeypatch.setenv("CHORUS_SSE_HEARTBEAT_S", "60")  # nothing but the re-check touches the database
    monkeypatch.setenv("PGAPPNAME", APP_NAME)
    portal = request.getfixturevalue("portal_server")
    session = factories.make_session()
    tokens = [token_create(user=viewer, name=f"sse-pool-{n}") for n in range(5)]

    streams = []
    try:
        for _token, raw in tokens:
            req = urllib.request.Request(f"{portal}/api/v1/sessions/{session.pk}/events/stream",
                                         headers={"Authorization": f"Bearer {raw}"})
            response = urllib.request.urlopen(req, timeout=30)
            assert response.status == 200
            assert response.readline().startswith(b": connected")
            streams.append(response)
        # A token's use is stamped at most once a minute: age the stamps, so a fresh one proves that
        # stream's re-check ran after all five were open.
        opened = timezone.now()
        ids = [token.pk for token, _raw in tokens]
        ApiToken.objects.filter(pk__in=ids).update(last_used_at=opened - timedelta(hours=1))
        wait_until(lambda: ApiToken.objects.filter(pk__in=ids, last_used_at__gte=opened).count() == len(ids),
                   timeout=30, message="every open stream to re-check its token")
        req = urllib.request.Request(portal + "/api/v1/sessions", headers={"Authorization": f"Bearer {tokens[0][1]}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                status, body = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, body = error.code, error.read()
        assert status == 200, body
    finally:
        for response in streams:
            response.close()
