from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ChorusSiteConfig(AppConfig):
    name = "chorus_site"
    verbose_name = "Chorus platform"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from .scrub import scrub_after_migrate

        # Every migrate scrubs secrets stored by older versions (chorus_site/scrub.py).
        post_migrate.connect(scrub_after_migrate, sender=self, dispatch_uid="chorus_site.scrub_after_migrate")
