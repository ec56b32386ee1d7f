"""A check of CHORUS_PUBLIC_URL, the start of every link in a notification: a value that is not an
absolute http(s) address would send links that lead nowhere.  (Unset, links are relative; no
deploy warning, so that ``check --deploy`` stays clean for a site that sends no notifications.)"""

from __future__ import annotations

from urllib.parse import urlsplit

from django.conf import settings
from django.core.checks import Error, Tags, register


@register(Tags.compatibility)
def public_url_valid(app_configs=None, **kwargs):
    value = settings.CHORUS_PUBLIC_URL
    parts = urlsplit(value)
    if value and (parts.scheme not in {"http", "https"} or not parts.netloc or parts.query or parts.fragment):
        return [Error(f"CHORUS_PUBLIC_URL must be an absolute http(s) address, not {value!r}",
                      hint="e.g. https://chorus.example.com (a path prefix is kept)", id="notifications.E001")]
    return []

