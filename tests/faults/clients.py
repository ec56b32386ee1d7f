"""Stream clients for fault tests: they behave like the product's own clients (SPEC §10).

``WsFollower`` is what ``chorus_site/static/chorus/live.js`` does: one ``/ws/live/`` socket, every
stream subscribed with the last cursor seen, and on any close a reconnect that resumes from it.
It has no stall detector of its own (neither has the browser): a socket that stays open but
delivers nothing is the portal's bug, and shows as events never received.

``SseFollower`` is an EventSource: one stream, ``Last-Event-ID`` on reconnect.  A stream silent
for ``stall_s`` (several heartbeat periods, SPEC §10) is counted as a stall, then reconnected.

Both run on a thread of their own and record what they received with the local arrival time.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import websockets

RECONNECT_DELAY_S = 0.2


@dataclass
class Received:
    """What one follower saw: event ids per stream (in arrival order) and connection history."""

    events: dict[str, list[int]] = field(default_factory=dict)
    arrived: dict[int, float] = field(default_factory=dict)  # event id -> time.time() of first arrival
    connects: list[float] = field(default_factory=list)
    closes: list[tuple[float, str]] = field(default_factory=list)  # (time, why)
    heartbeats: list[float] = field(default_factory=list)
    stalls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, stream: str, event_id: int):
        with self.lock:
            self.events.setdefault(stream, []).append(event_id)
            self.arrived.setdefault(event_id, time.time())

    def last(self, stream: str) -> int | None:
        with self.lock:
            ids = self.events.get(stream)
            return ids[-1] if ids else None

    def ids(self, stream: str) -> list[int]:
        with self.lock:
            return list(self.events.get(stream, []))

    def reconnect_times(self) -> list[float]:
        """Seconds from each close to the next successful (re)connect."""
        with self.lock:
            out = []
            for closed_at, _why in self.closes:
                later = [c for c in self.connects if c >= closed_at]
                if later:
                    out.append(later[0] - closed_at)
            return out


class WsFollower(threading.Thread):
    def __init__(self, portal: str, session_cookie: str, streams: list[str]):
        super().__init__(daemon=True, name="ws-follower")
        parts = urlsplit(portal)
        self.url = f"ws://{parts.netloc}/ws/live/"
        self.headers = {"Cookie": f"sessionid={session_cookie}", "Origin": portal}
        self.streams = streams
        self.received = Received()
        self.subscribed = threading.Event()
        self._halt = threading.Event()
        self.errors: list[dict] = []

    def stop(self):
        self._halt.set()
        self.join(timeout=10)

    def run(self):
        asyncio.run(self._main())

    async def _main(self):
        while not self._halt.is_set():
            why = "closed"
            try:
                async with websockets.connect(self.url, additional_headers=self.headers, open_timeout=5,
                                              ping_interval=None, close_timeout=2) as socket:
                    with self.received.lock:
                        self.received.connects.append(time.time())
                    for stream in self.streams:
                        # Like live.js: the cursor of the last event seen, else from the stream's start.
                        after = self.received.last(stream)
                        await socket.send(json.dumps({"type": "subscribe", "stream": stream,
                                                      "after": after if after is not None else 0}))
                    why = await self._read(socket)
            except (OSError, websockets.WebSocketException, asyncio.TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            with self.received.lock:
                self.received.closes.append((time.time(), why))
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _read(self, socket) -> str:
        pending = set(self.streams)
        while not self._halt.is_set():
            try:
                frame = await asyncio.wait_for(socket.recv(), timeout=0.5)
            except asyncio.TimeoutError:
                continue
            except websockets.ConnectionClosed as closed:
                return f"close frame {closed.rcvd.code if closed.rcvd else None}"
            message = json.loads(frame)
            if message["type"] == "subscribed":
                pending.discard(message["stream"])
                if not pending:
                    self.subscribed.set()
            elif message["type"] == "event":
                self.received.add(message["event"]["stream"], message["event"]["id"])
            elif message["type"] == "events":  # held agent output, sent as one frame (chorus_site/consumers.py)
                for event in message["events"]:
                    self.received.add(event["stream"], event["id"])
            elif message["type"] == "error":
                self.errors.append(message)
        return "stopped"


class SseFollower(threading.Thread):
    def __init__(self, portal: str, token: str, path: str, stream: str, *, stall_s: float):
        super().__init__(daemon=True, name=f"sse-follower-{stream[-6:]}")
        parts = urlsplit(portal)
        self.host, self.port = parts.hostname, parts.port
        self.path, self.stream, self.token, self.stall_s = path, stream, token, stall_s
        self.received = Received()
        self.connected = threading.Event()
        self._halt = threading.Event()

    def stop(self):
        self._halt.set()
        self.join(timeout=self.stall_s + 10)

    def run(self):
        while not self._halt.is_set():
            why = "closed"
            try:
                why = self._once()
            except (OSError, http.client.HTTPException) as exc:
                why = f"{type(exc).__name__}: {exc}"
            with self.received.lock:
                self.received.closes.append((time.time(), why))
            if not self._halt.is_set():
                time.sleep(RECONNECT_DELAY_S)

    def _once(self) -> str:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.stall_s)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "text/event-stream"}
        last = self.received.last(self.stream)
        path = self.path + ("" if last is not None else "?after=0")
        if last is not None:
            headers["Last-Event-ID"] = str(last)
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                return f"status {response.status}: {response.read()[:200]!r}"
            with self.received.lock:
                self.received.connects.append(time.time())
            self.connected.set()
            event_id = None
            while not self._halt.is_set():
                try:
                    line = response.readline()
                except TimeoutError:
                    with self.received.lock:
                        self.received.stalls += 1
                    return "stalled"
                if not line:
                    return "eof"
                text = line.decode().rstrip("\n")
                if text.startswith(": heartbeat"):
                    with self.received.lock:
                        self.received.heartbeats.append(time.time())
                elif text.startswith("id: "):
                    event_id = int(text[4:])
                elif text.startswith("data: ") and event_id is not None:
                    self.received.add(json.loads(text[6:])["stream"], event_id)
                    event_id = None
            return "stopped"
        finally:
            conn.close()
