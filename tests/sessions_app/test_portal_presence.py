"""The stale sweep judges only a silence the portal could hear (issue 7 item 8, SPEC §11 R9):
while no portal process is up, and for one threshold after one is back, no daemon is taken for
gone (chorus_site/presence.py).  The end-to-end case is tests/faults/test_daemon_truth.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from chorus_site import presence
from chorus_site.models import PortalPresence
from sessions_app import bridge
from sessions_app.models import Connection, Turn
from tests.sessions_app.test_sweeps import connection, online, running_turn, threshold_s  # noqa: F401

pytestmark = pytest.mark.django_db


def portal(*, up_for_s: float, seen_s_ago: float = 0.0):
    now = timezone.now()
    PortalPresence.objects.update_or_create(pk=1, defaults={"alive_at": now - timedelta(seconds=seen_s_ago),
                                                             "up_since": now - timedelta(seconds=up_for_s)})


def status(turn) -> tuple[str, str]:
    turn = Turn.objects.get(pk=turn.pk)
    return turn.status, turn.interrupted_reason


def test_a_daemon_silent_while_the_portal_was_down_is_not_settled(operator, connection):
    turn = running_turn(operator, connection)
    online(connection, age_s=3 * threshold_s())    # its last frame came before the portal went down
    portal(up_for_s=1)                            # ... and the portal is back since a second
    result = bridge.connections_sweep_stale()
    assert (result["connections_offline"], result["turns_settled"]) == (0, 0)
    assert status(turn) == ("running", "")
    assert Connection.objects.get(pk=connection.pk).status == "online"

    portal(up_for_s=3 * threshold_s(), seen_s_ago=presence.DOWN_AFTER_S + 1)  # the portal is down now
    assert bridge.connections_sweep_stale()["turns_settled"] == 0
    assert status(turn) == ("running", "")

    # Up for a whole threshold and the daemon still silent: now it is judged.
    portal(up_for_s=threshold_s() + 1)
    assert bridge.connections_sweep_stale()["turns_settled"] == 1
    assert status(turn) == ("interrupted", "offline")


def test_a_daemon_silent_while_the_portal_was_up_is_settled_as_before(operator, connection):
    turn = running_turn(operator, connection)
    online(connection, age_s=threshold_s() + 1)
    portal(up_for_s=3 * threshold_s())
    assert bridge.connections_sweep_stale()["turns_settled"] == 1
    assert status(turn) == ("interrupted", "offline")


def test_each_refresh_keeps_the_up_period_and_a_gap_starts_a_new_one():
    start = timezone.now()
    presence.presence_refresh(now=start)
    for step in (1, 2, 3):  # several processes refresh, each within DOWN_AFTER_S of another
        presence.presence_refresh(now=start + timedelta(seconds=step * presence.REFRESH_S))
    row = PortalPresence.objects.get()
    assert row.up_since == start
    assert presence.portal_up_since(now=row.alive_at) == start
    assert presence.portal_up_since(now=row.alive_at + timedelta(seconds=presence.DOWN_AFTER_S + 1)) is None
    # An older refresh (a process whose clock lags) does not move alive_at back.
    presence.presence_refresh(now=start)
    assert PortalPresence.objects.get().alive_at == row.alive_at

    back = row.alive_at + timedelta(seconds=presence.DOWN_AFTER_S + 1)   # nobody refreshed meanwhile
    presence.presence_refresh(now=back)
    assert PortalPresence.objects.get().up_since == back
    assert presence.portal_up_since(now=back) == back


def test_the_test_process_runs_no_presence_refresher():
    """Importing the ASGI app here (as in-process socket tests do) must not start the refresher:
    it would write this row into every later test's database (tests/conftest.py)."""
    import threading

    import chorus_site.asgi  # noqa: F401

    presence.presence_keep()
    assert not [t for t in threading.enumerate() if t.name == "chorus-portal-presence"]
    assert not PortalPresence.objects.exists()
