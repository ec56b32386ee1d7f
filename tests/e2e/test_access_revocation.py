"""Revoked access ends open streams (issue 8 item 6), over real sockets against a real daphne.

A /ws/live/ socket closes within 10 s of its user's role being removed, the user being
deactivated or the login session being deleted; an SSE stream ends within 10 s of its token
being revoked or its user's role being removed.  A holder who keeps access keeps receiving.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from urllib.parse import urlsplit

import pytest
from django.contrib.sessions.models import Session as LoginSession
from django.test import Client
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from chorus_site import permissions
from chorus_site.events import event_append
from chorus_site.tokens import token_create, token_revoke
from tests import factories
from tests.conftest import role_group
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

REVOKED_WITHIN_S = 10


def _viewer(name):
    return factories.make_user(username=name, groups=[role_group(permissions.VIEWER)])


def _cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


class Socket:
    def __init__(self, stack: contextlib.ExitStack, base: str, cookie: str, stream: str):
        host = urlsplit(base).netloc
        self.ws = stack.enter_context(ws_connect(f"ws://{host}/ws/live/", origin=f"http://{host}",
                             additional_headers={"Cookie": f"sessionid={cookie}"}, open_timeout=10))
        self.frames: list[dict] = []
        self.closed = False
        self.ws.send(json.dumps({"type": "subscribe", "stream": stream}))
        wait_until(lambda: self.drain() or any(f["type"] == "subscribed" for f in self.frames), timeout=10,
                   message="the subscription")

    def drain(self) -> bool:
        """Read what has arrived; True once the socket is closed."""
        while not self.closed:
            try:
                self.frames.append(json.loads(self.ws.recv(timeout=0.02)))
            except TimeoutError:
                break
            except ConnectionClosed:
                self.closed = True
        return self.closed

    def events(self) -> list[int]:
        return [f["event"]["data"]["n"] for f in self.frames if f["type"] == "event"]


def _ticker(stream):
    counter = iter(range(1, 10_000))

    def tick() -> int:
        n = next(counter)
        event_append(stream=stream, kind="test.tick", data={"n": n})
        return n

    return tick


def test_live_sockets_close_when_access_is_revoked(portal_server):
    with contextlib.ExitStack() as stack:
        _follow_and_revoke(stack, portal_server)


def _follow_and_revoke(stack, portal_server):
    session = factories.make_session()
    users = {name: _viewer(name) for name in ("keeps", "role_removed", "deactivated", "logged_out")}
    cookies = {name: _cookie(user) for name, user in users.items()}
    sockets = {name: Socket(stack, portal_server, cookies[name], session.stream) for name in users}
    tick = _ticker(session.stream)
    first = tick()
    wait_until(lambda: all(s.drain() or first in s.events() for s in sockets.values()), timeout=10,
               message="every socket to receive a live event")

    users["role_removed"].groups.clear()
    users["deactivated"].is_active = False
    users["deactivated"].save(update_fields=["is_active"])
    LoginSession.objects.filter(session_key=cookies["logged_out"]).delete()
    revoked = ["role_removed", "deactivated", "logged_out"]

    def all_revoked_closed():
        tick()
        for socket in sockets.values():
            socket.drain()
        return all(sockets[name].closed for name in revoked)

    wait_until(all_revoked_closed, timeout=REVOKED_WITHIN_S, interval=0.2,
               message="the revoked sockets to close")
    for name in revoked:
        assert any(f["type"] == "error" and f["code"] == "unauthorized" for f in sockets[name].frames), name
    # The holder who kept access still receives new events.
    after = tick()
    wait_until(lambda: sockets["keeps"].drain() or after in sockets["keeps"].events(), timeout=10,
               message="the remaining socket to receive")
    assert not sockets["keeps"].closed


class Sse:
    def __init__(self, base: str, token: str, path: str):
        parts = urlsplit(base)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        self.conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.ids: list[int] = []
        self.ended = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            while True:
                line = self.response.readline()
                if not line:
                    break
                if line.startswith(b"data: "):
                    self.ids.append(json.loads(line[6:])["data"]["n"])
        except (OSError, ValueError, AttributeError, http.client.HTTPException):  # closed by the test
            pass
        self.ended = True


def test_sse_streams_end_when_the_token_is_revoked_or_the_role_removed(portal_server):
    session = factories.make_session()
    users = {name: _viewer(name) for name in ("keeps", "token_revoked", "role_removed")}
    tokens = {name: token_create(user=user, name="sse") for name, user in users.items()}
    path = f"/api/v1/sessions/{session.pk}/events/stream"
    streams = {name: Sse(portal_server, raw, path) for name, (_token, raw) in tokens.items()}
    tick = _ticker(session.stream)
    first = tick()
    wait_until(lambda: all(first in s.ids for s in streams.values()), timeout=10,
               message="every stream to deliver a live event")

    token_revoke(prefix=tokens["token_revoked"][0].prefix)
    users["role_removed"].groups.clear()

    def revoked_ended():
        tick()
        return streams["token_revoked"].ended and streams["role_removed"].ended

    wait_until(revoked_ended, timeout=REVOKED_WITHIN_S, interval=0.2, message="the revoked streams to end")
    after = tick()
    wait_until(lambda: after in streams["keeps"].ids, timeout=10, message="the remaining stream to deliver")
    assert not streams["keeps"].ended
    streams["keeps"].conn.close()
