"""The daemon's report spool health reaches the connection's admin page (issue 7 item 3)."""

from __future__ import annotations

import time

import pytest
from django.test import Client

from sessions_app import bridge
from sessions_app.models import Connection
from tests import factories

pytestmark = pytest.mark.django_db


def page(user, connection) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(f"/admin/sessions_app/connection/{connection.pk}/change/")
    assert response.status_code == 200
    return response.content.decode()


def test_parked_refusals_show_on_the_connections_page(operator):
    connection = factories.make_connection(cwds=["/srv/work"])
    assert "has not reported its spool yet" in page(operator, connection)
    bridge.connection_daemon_connected(connection_id=connection.pk, hello={"version": "0.1.0", "spool": {
        "queued": 0, "parked": 0}})
    bridge.connection_heartbeat(connection_id=connection.pk, spool={
        "queued": 3, "parked": 2, "refused_total": 12, "oldest_queued_age_s": 4.5, "oldest_parked_age_s": 61.0,
        "last_refusal": {"report_id": "rep-77", "path": "/daemon/turns/t/advance", "status": 409,
                         "code": "invalid_transition", "at": time.time()}})
    html = page(operator, connection)
    assert 'id="spool-queued">3<' in html and 'id="spool-parked">2<' in html
    assert "rep-77" in html and "invalid_transition" in html and "chorus-error" in html
    # A heartbeat merges the spool figure in; what the hello stored stays.
    stored = Connection.objects.get(pk=connection.pk).capabilities
    assert stored["spool"]["parked"] == 2
    bridge.connection_heartbeat(connection_id=connection.pk, spool={"queued": 0, "parked": 0})
    assert 'id="spool-parked">0<' in page(operator, connection)
