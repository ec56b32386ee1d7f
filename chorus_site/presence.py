"""Is the portal's daemon-facing side up, and since when (issue 7 item 8, SPEC §11 R9).

A daemon's silence means something only while the portal could hear it.  The stale sweep runs in
Celery, which keeps running while every portal process is down (daphne restarted, deployed,
crashed): without this record it took the daemons' silence during the outage for their death and
settled their live turns ``interrupted(offline)``.

Every portal process (each daphne serving ``/ws/daemon/`` and the daemon API) refreshes one shared
row every ``REFRESH_S``.  A refresh that finds the row older than ``DOWN_AFTER_S`` starts a new
up-period (``up_since``): no portal process was up in between.  The sweep judges a daemon silent
only when both its last frame and the start of the current up-period are older than the threshold,
so after an outage every daemon has a full threshold to reconnect; and while the row is not being
refreshed (the portal is down now) it judges nobody.  With several processes the row is up while
any of them is (a daemon whose process died reconnects to another within its backoff).

``DOWN_AFTER_S`` stays well below the heartbeat threshold: an outage shorter than it is not seen,
so the daemon's heartbeat interval, the outage and its reconnect must still fit in the threshold.
"""

from __future__ import annotations

import logging
import sys
import threading
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

log = logging.getLogger(__name__)

REFRESH_S = 1.0
DOWN_AFTER_S = 3.0
# No row at all: no portal process ever ran against this database (a fresh install, unit tests),
# so there is no outage to account for: heartbeats alone decide.
NO_RECORD = datetime.min.replace(tzinfo=dt_timezone.utc)

_started = threading.Lock()
_thread: threading.Thread | None = None


def presence_refresh(*, now=None) -> None:
    """This portal process is up: keep the row's ``alive_at``; after a gap, a new ``up_since``."""
    from .models import PortalPresence

    now = now or timezone.now()
    try:
        with transaction.atomic():
            row = PortalPresence.objects.select_for_update(no_key=True).filter(pk=1).first()
            if row is None:
                PortalPresence.objects.create(pk=1, alive_at=now, up_since=now)
                return
            if now - row.alive_at > timedelta(seconds=DOWN_AFTER_S):
                row.up_since = now  # nobody refreshed in between: the portal was down
            row.alive_at = max(row.alive_at, now)
            row.save(update_fields=["alive_at", "up_since"])
    except IntegrityError:
        pass  # another process created the row at the same moment: it is up, so is the portal


def portal_up_since(*, now=None) -> datetime | None:
    """Since when the portal has been able to hear daemons without a gap; None: it is down now."""
    from .models import PortalPresence

    now = now or timezone.now()
    row = PortalPresence.objects.filter(pk=1).first()
    if row is None:
        return NO_RECORD
    if now - row.alive_at > timedelta(seconds=DOWN_AFTER_S):
        return None
    return row.up_since


def silence_judged_since(cutoff: datetime, *, now=None) -> bool:
    """May a silence that began before ``cutoff`` be held against a daemon?  Only if the portal has
    been up, without a gap, since before it."""
    since = portal_up_since(now=now)
    return since is not None and since <= cutoff


def presence_keep() -> None:
    """Start this process' refresher once (from chorus_site.asgi: only portal processes run it).

    Under daphne it stops as soon as the server begins to shut down: daphne stops listening at once
    but lives on for a while closing its sockets, and a process that no daemon can reach must not
    say the portal hears them (a SIGKILLed process stops with its thread)."""
    global _thread
    if not settings.CHORUS_PORTAL_PRESENCE:
        return  # a process that imports the ASGI app without serving daemons (the test process)
    with _started:
        if _thread is not None and _thread.is_alive():
            return
        stopping = threading.Event()
        reactor = sys.modules.get("twisted.internet.reactor")  # installed by daphne before it loads us
        if reactor is not None:
            reactor.addSystemEventTrigger("before", "shutdown", stopping.set)
        _thread = threading.Thread(target=_keep, args=(stopping,), name="chorus-portal-presence", daemon=True)
        _thread.start()


def _keep(stopping: threading.Event) -> None:
    while not stopping.is_set():  # or ends with its process (a daemon thread)
        try:
            presence_refresh()
        except Exception:  # noqa: BLE001 — the database is away: the sweep then judges nobody
            log.warning("portal presence not refreshed", exc_info=True)
        finally:
            connection.close()  # this thread's own: back to the pool (if any), never pinned between refreshes
        stopping.wait(REFRESH_S)
