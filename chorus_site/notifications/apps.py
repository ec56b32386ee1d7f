from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    """Notification rules and their deliveries (issue 12 item 2; docs/alerts.md).

    On the top floor with executions: it reads turns, connections and runs, nobody imports it."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "chorus_site.notifications"
    label = "notifications"  # tables, migrations and permissions keep the short name

    def ready(self):
        from . import checks, hooks  # noqa: F401 — checks registers itself

        hooks.connect()
