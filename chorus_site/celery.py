import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chorus_site.settings")

# Scheduled jobs claim their period, so a second beat cannot make them run twice (chorus_site/periodic.py).
app = Celery("chorus_site", task_cls="chorus_site.periodic:PeriodicOnceTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Task latency and run time for /metrics (chorus_site/metrics.py), in publishers and workers alike.
from chorus_site.metrics import celery_signals_connect  # noqa: E402 — after the app exists

celery_signals_connect()
