from django.apps import AppConfig


class ChorusSiteConfig(AppConfig):
    name = "chorus_site"
    verbose_name = "Chorus platform"
    default_auto_field = "django.db.models.BigAutoField"
