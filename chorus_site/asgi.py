"""ASGI entry point: HTTP (admin, API, SSE) and WebSocket (/ws/live/, /ws/daemon/)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chorus_site.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_http = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402

from chorus_site.presence import presence_keep  # noqa: E402
from chorus_site.routing import daemon_urlpatterns, websocket_urlpatterns  # noqa: E402

if settings.CHORUS_SERVE_STATIC:
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    django_http = ASGIStaticFilesHandler(django_http)

browser_websockets = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
# Daemons are not browsers: they send no Origin and authenticate with their connection key.
daemon_websockets = URLRouter(daemon_urlpatterns)


async def websocket_app(scope, receive, send):
    app = daemon_websockets if scope["path"].startswith("/ws/daemon/") else browser_websockets
    return await app(scope, receive, send)


# This process serves daemons: it says so while it is up, so the stale sweep (Celery) never takes
# the silence of a portal outage for the daemons' (chorus_site/presence.py).
presence_keep()

application = ProtocolTypeRouter(
    {
        "http": django_http,
        "websocket": websocket_app,
    }
)
