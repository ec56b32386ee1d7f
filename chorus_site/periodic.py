"""Each periodic job runs once per period, however many beats and workers run (issue 9 item 5).

The sweeps and ticks of ``CELERY_BEAT_SCHEDULE`` are sent by celery beat. Exactly one beat is the
documented topology, but a second one (a worker started with ``-B`` beside the beat, a fail-over
started before the old one stopped) sends every job twice per period, and two workers run both
copies at once. So a worker runs a scheduled job only after claiming its period in Redis (the
broker, which every worker shares): ``SET chorus:periodic:<task> NX PX <0.8 period>``. A copy that
finds the claim taken is skipped (logged), so two runs of one job are always at least 0.8 period
apart. Redis restarted empty loses the claims: at worst one job runs twice once — the jobs are
safe to run twice, this keeps them from doing it all the time.

Only worker executions claim: a task called directly or applied eagerly (embedded mode, tests) runs
as asked. Every claimed run is also counted (``chorus:periodic:<task>:runs``, a list of start
times kept for a day) for the deployment check in docs/deployment.md and the scale-out test.
"""

from __future__ import annotations

import logging
import time

from celery import Task

log = logging.getLogger(__name__)

CLAIM_SHARE = 0.8  # of the period: a late beat still gets the next period, a double never
RUNS_KEPT = 1000
_redis = None


def schedule_periods() -> dict[str, float]:
    """Task name -> period in seconds of the beat schedule's fixed-interval entries."""
    from django.conf import settings

    periods = {}
    for entry in getattr(settings, "CELERY_BEAT_SCHEDULE", {}).values():
        schedule = entry.get("schedule")
        if isinstance(schedule, (int, float)):
            periods[entry["task"]] = float(schedule)
        elif hasattr(schedule, "total_seconds"):
            periods[entry["task"]] = schedule.total_seconds()
    return periods


def claim_key(task_name: str) -> str:
    return f"chorus:periodic:{task_name}"


def runs_key(task_name: str) -> str:
    return f"chorus:periodic:{task_name}:runs"


def _client():
    global _redis
    if _redis is None:
        import redis
        from django.conf import settings

        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=3)
    return _redis


def period_claim(task_name: str, period_s: float) -> bool:
    """True if this run may go ahead: nobody ran ``task_name`` in the last 0.8 period.

    A Redis that does not answer lets the run go ahead: a double run is harmless, a sweep that
    never runs is not.
    """
    try:
        client = _client()
        if not client.set(claim_key(task_name), str(time.time()), nx=True, px=max(1, int(period_s * 1000 * CLAIM_SHARE))):
            return False
        pipe = client.pipeline()
        pipe.rpush(runs_key(task_name), f"{time.time():.3f}")
        pipe.ltrim(runs_key(task_name), -RUNS_KEPT, -1)
        pipe.expire(runs_key(task_name), 86400)
        pipe.execute()
    except Exception:  # noqa: BLE001 - Redis down: run (the tasks are safe to run twice)
        log.warning("could not claim the period of %s; running it anyway", task_name, exc_info=True)
    return True


class PeriodicOnceTask(Task):
    """The project's Celery task class (chorus_site/celery.py): scheduled jobs claim their period."""

    def __call__(self, *args, **kwargs):
        request = self.request
        if not request.called_directly and not request.is_eager:
            period = schedule_periods().get(self.name)
            if period is not None and not period_claim(self.name, period):
                log.info("%s: this period's run has already been claimed by another copy; skipped", self.name)
                return None
        return super().__call__(*args, **kwargs)
