"""A portal process holds at most DATABASE_POOL_MAX_SIZE server connections (issue 9 item 5).

Without a pool every request in flight held a connection of its own (each ASGI request runs in a
thread of its own), so a burst on one process took as many of PostgreSQL's max_connections as it
had requests waiting; 10 processes could exhaust the server. The portal's connections are told
apart by their application name (libpq's PGAPPNAME).
"""

from __future__ import annotations

import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from chorus_site.tokens import token_create
from tests import factories
from tests.e2e.conftest import portal_server  # noqa: F401  (the fixture, used by name)
from tests.e2e.conftest import test_database_url as database_url_of_tests

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
