from django.urls import path

from sessions_app.consumers import DaemonConsumer

from .consumers import LiveConsumer

websocket_urlpatterns = [
    path("ws/live/", LiveConsumer.as_asgi()),
]

daemon_urlpatterns = [
    path("ws/daemon/", DaemonConsumer.as_asgi()),
]
