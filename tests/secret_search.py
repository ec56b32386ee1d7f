"""Where secrets survive: every row of every table of the database, as text (issue 8 canary suite)."""

from __future__ import annotations

from django.db import connection


def database_texts() -> dict[str, str]:
    """{table: all its rows as JSON text} for every table of the database (PostgreSQL)."""
    out = {}
    tables = sorted(connection.introspection.table_names())  # every table, a model's or not
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f'SELECT coalesce(string_agg(row_to_json(t)::text, chr(10)), \'\') FROM "{table}" t')
            out[table] = cursor.fetchone()[0]
    return out


def places_found(secrets: dict[str, str], texts: dict[str, str]) -> dict[str, list[str]]:
    """{canary id: [places whose text holds its secret]} for the canaries found anywhere."""
    found = {}
    for cid, secret in secrets.items():
        where = [place for place, text in texts.items() if secret in text]
        if where:
            found[cid] = where
    return found


class LiveCapture:
    """What is received live while a scenario runs (issue 8 canary suite, R6).

    Per role: every ``/ws/live/`` frame (signed in with the role's session cookie; the dashboard,
    plus the streams named through ``follow``, each from its first event) and every SSE frame of
    the session and run streams named through ``follow`` (with the role's API token).  And every
    command sent to the Redis database (``MONITOR``): Celery's task messages (their arguments,
    base64 in the message, decoded) and the channel layer's messages.  A background thread runs
    the sockets; ``stop()`` returns {place: text}.
    """

    def __init__(self, base_url: str, roles: dict[str, tuple[str, str]], redis_url: str):
        """``roles``: {name: (session cookie value, API token)}."""
        import threading
        from urllib.parse import urlsplit

        self.base, self.roles, self.redis_url = base_url, roles, redis_url
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname, parts.port
        self.ws_frames = {name: [] for name in roles}
        self.sse_text = {name: [] for name in roles}
        self.redis_lines: list[str] = []
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._loop = None
        self._tasks: list = []
        self._sockets: dict = {}
        self._followed: set = set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._monitor = threading.Thread(target=self._monitor_redis, daemon=True)

    # ---------------------------------------------------------------- control (test thread)
    def start(self) -> "LiveCapture":
        self._monitor.start()
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("the live sockets did not connect")
        return self

    def follow(self, *, streams=(), sse_paths=()):
        """Subscribe every role's socket to ``streams`` (from their first event) and open SSE ``sse_paths``."""
        import asyncio

        new_streams = [s for s in streams if ("ws", s) not in self._followed]
        new_paths = [p for p in sse_paths if ("sse", p) not in self._followed]
        self._followed |= {("ws", s) for s in new_streams} | {("sse", p) for p in new_paths}
        if new_streams or new_paths:
            asyncio.run_coroutine_threadsafe(self._follow(new_streams, new_paths), self._loop).result(timeout=30)

    def stop(self) -> dict[str, str]:
        import asyncio

        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
        self._stopping.set()
        self._thread.join(timeout=30)
        self._monitor.join(timeout=10)
        texts = {}
        for name in self.roles:
            texts[f"ws frames ({name})"] = "\n".join(self.ws_frames[name])
            texts[f"sse frames ({name})"] = "".join(self.sse_text[name])
        texts["redis commands"] = "\n".join(self.redis_lines)
        texts["celery task arguments"] = "\n".join(celery_task_bodies(self.redis_lines))
        return texts

    # ---------------------------------------------------------------- the sockets' thread
    def _run(self):
        import asyncio

        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self):
        import asyncio

        from websockets.asyncio.client import connect

        for name, (cookie, _token) in self.roles.items():
            from django.conf import settings

            socket = await connect(f"ws://{self.host}:{self.port}/ws/live/", origin=self.base,
                                   additional_headers={"Cookie": f"{settings.SESSION_COOKIE_NAME}={cookie}"})
            self._sockets[name] = socket
            self._tasks.append(asyncio.ensure_future(self._read_ws(name, socket)))
            await socket.send('{"type": "subscribe", "stream": "dashboard"}')
        self._ready.set()
        while not self._stopping.is_set():
            await asyncio.sleep(0.1)

    async def _read_ws(self, name, socket):
        try:
            async for frame in socket:
                self.ws_frames[name].append(frame if isinstance(frame, str) else frame.decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 — a closed socket ends the capture of this role
            return

    async def _follow(self, streams, paths):
        import asyncio
        import json

        for name, socket in self._sockets.items():
            for stream in streams:
                await socket.send(json.dumps({"type": "subscribe", "stream": stream, "after": 0}))
            for path in paths:
                self._tasks.append(asyncio.ensure_future(self._read_sse(name, path)))

    async def _read_sse(self, name, path):
        import asyncio

        reader, writer = await asyncio.open_connection(self.host, self.port)
        token = self.roles[name][1]
        writer.write((f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
                      "Accept: text/event-stream\r\n\r\n").encode())
        await writer.drain()
        try:
            while chunk := await reader.read(65536):
                self.sse_text[name].append(chunk.decode("utf-8", "replace"))
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()

    async def _close(self):
        import asyncio

        for socket in self._sockets.values():
            await socket.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---------------------------------------------------------------- Redis MONITOR
    def _monitor_redis(self):
        import redis

        client = redis.Redis.from_url(self.redis_url)
        db = client.connection_pool.connection_kwargs.get("db", 0)
        connection = client.connection_pool.get_connection()
        connection.send_command("MONITOR")
        connection.read_response()
        mark = f"[{db} "
        try:
            while not self._stopping.is_set():
                if not connection.can_read(timeout=0.2):
                    continue
                line = connection.read_response()
                line = line.decode("utf-8", "replace") if isinstance(line, bytes) else str(line)
                if mark in line[:40]:  # the other databases of a shared Redis are not ours
                    self.redis_lines.append(line)
        finally:
            connection.disconnect()


def celery_task_bodies(monitor_lines: list[str]) -> list[str]:
    """The decoded bodies (args, kwargs) and argsrepr/kwargsrepr of every Celery message published."""
    import base64
    import re

    bodies = []
    for line in monitor_lines:
        unescaped = line.replace('\\"', '"')
        for body in re.findall(r'"body": "([A-Za-z0-9+/=]+)"', unescaped):
            bodies.append(base64.b64decode(body).decode("utf-8", "replace"))
        bodies += re.findall(r'"(?:argsrepr|kwargsrepr)": "((?:[^"\\]|\\.)*)"', unescaped)
    return bodies
