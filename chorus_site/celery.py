import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chorus_site.settings")

# Scheduled jobs claim their period, so a second beat cannot make them run twice (chorus_site/periodic.py).
app = Celery("chorus_site", task_cls="chorus_site.periodic:PeriodicOnceTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
