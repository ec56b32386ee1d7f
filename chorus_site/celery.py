import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chorus_site.settings")

app = Celery("chorus_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
