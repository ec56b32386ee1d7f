"""``/ws/daemon/``: a daemon's control and presence channel (SPEC §5, agents/protocol.py).

The daemon authenticates with ``Authorization: Bearer <connection key>``.  Commands are persisted
before they are pushed, so a reconnecting daemon gets every command it has not acked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from agents import protocol

from chorus_site.errors import ApplicationError
from chorus_site.metrics import LIVE_CLIENTS
from chorus_site.layer_health import LayerAwareConsumer, health
from chorus_site.throttling import credential_failed, credential_gate

from . import bridge, daemon_schemas, stalls

log = logging.getLogger(__name__)


def _bearer(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            text = value.decode("latin-1")
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
    return None


# The push through the channel layer is a wake-up only (it may be dropped, or come from a process
# that shares no in-memory layer with this one): pending commands are also looked for this often.
COMMAND_POLL_S = 2.0
# While the channel layer is broken (Redis down or restarted empty), re-join the group this often.
LAYER_REJOIN_S = 1.0
# Liveness never depends on throughput (issue 9 item 2).  Channels' ``database_sync_to_async`` runs
# every call of every consumer of the process on one shared thread; with many busy daemons their
# heartbeats queued there and the stale sweep took live daemons for gone.  Here the presence writes
# have threads of their own, and a daemon's other frames (hello, snapshot, acks, results: serial per
# socket, as sent) and command polls run on a pool of their own, behind which a heartbeat never waits.
LIVENESS_EXECUTOR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chorus-liveness")
CONTROL_EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="chorus-daemon-control")
# A frame of any kind shows the daemon alive; its presence is written at most this often.
SEEN_WRITE_S = 1.0
# At a close, the frames still queued are handled for up to this long before presence goes down.
CONTROL_DRAIN_S = 10.0


def on_liveness_threads(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=LIVENESS_EXECUTOR)


def on_control_threads(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=CONTROL_EXECUTOR)


class DaemonConsumer(LayerAwareConsumer, AsyncWebsocketConsumer):
    """Serves its daemon whatever the channel layer does: heartbeats, reports and the command poll
    need only the database; the layer (a wake-up for pushes) is re-joined when it answers again."""

    connection_id = None
    poller = None
    control = None          # the task handling this socket's frames other than heartbeats, in order
    seen_written_at = 0.0   # monotonic time of the last presence write

    async def connect(self):
        ident = str((self.scope.get("client") or ("unknown",))[0])
        key = _bearer(self.scope)
        try:
            credential_gate(ident, key)
        except ApplicationError:
            await self.close(code=4429)  # too many failed key checks from this address: retry later
            return
        connection = await on_control_threads(bridge.connection_authenticate)(key)
        if connection is None:
            credential_failed(ident, key)
            await self.close(code=4401)
            return
        self.connection_id = connection.pk
        self.group = bridge.daemon_group(connection.pk)
        await self.layer_join(self.group)  # a broken layer is re-joined later (layer_recover)
        await self.accept()
        LIVE_CLIENTS.labels("daemon").inc()  # /metrics; taken back in disconnect
        self.counted = True
        replaced = await on_control_threads(bridge.connection_socket_claim)(
            connection_id=connection.pk, socket=self.channel_name, client=ident)
        if replaced:
            try:  # close it at once; else its own poll notices within COMMAND_POLL_S
                await self.channel_layer.send(replaced, {"type": "daemon.replaced"})
            except Exception:  # noqa: BLE001 - the layer is a wake-up only
                log.info("could not tell the replaced socket of %s to close", connection.pk, exc_info=True)
        await self._send({"type": protocol.WELCOME, "connection": str(connection.pk),
                          "heartbeat_interval_s": protocol.HEARTBEAT_INTERVAL_S,
                          "heartbeat_timeout_s": settings.CHORUS_HEARTBEAT_TIMEOUT_S})
        self.frames: asyncio.Queue = asyncio.Queue()
        self.control = asyncio.ensure_future(self._handle_frames())
        self.poller = asyncio.ensure_future(self._poll_commands())

    async def _poll_commands(self):
        while True:
            await asyncio.sleep(COMMAND_POLL_S)
            try:
                if not await on_control_threads(bridge.connection_socket_is_current)(
                        connection_id=self.connection_id, socket=self.channel_name):
                    await self.daemon_replaced({})
                    return
                if await on_control_threads(bridge.commands_pending)(connection_id=self.connection_id):
                    await self.commands_push({})
            except Exception:  # a database blip must not end the poll for the life of the socket
                log.warning("command poll of %s failed", self.connection_id, exc_info=True)

    async def layer_failed(self, message):
        log.warning("daemon %s: channel layer lost; serving from the database until it is back", self.connection_id)

    async def layer_recover(self):
        """Re-join the daemon's group once the layer answers; then look for commands at once."""
        while True:
            await asyncio.sleep(LAYER_REJOIN_S)
            if self.connection_id is None:
                continue
            generation = health.generation
            self.layer_lost = False
            if await self.layer_join(self.group):
                self.layer_generation = generation
                log.info("daemon %s: channel layer back", self.connection_id)
                return {"type": "commands.push"}

    async def daemon_replaced(self, event):
        """A newer socket with this connection's key speaks for it now: this one stops serving."""
        if self.connection_id is None:
            return
        await self._send({"type": protocol.ERROR, "code": "replaced",
                          "message": "a newer socket of this connection replaced this one"})
        await self.close(code=protocol.SOCKET_REPLACED_CLOSE)

    async def disconnect(self, code):
        if getattr(self, "counted", False):
            self.counted = False
            LIVE_CLIENTS.labels("daemon").dec()
        if self.poller is not None:
            self.poller.cancel()
        if self.connection_id is None:
            return
        if self.control is not None:  # what the daemon sent before it went (acks, results) still counts
            self.frames.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(self.control), CONTROL_DRAIN_S)
            except asyncio.TimeoutError:
                log.warning("daemon %s: frames still queued at its close were dropped", self.connection_id)
                self.control.cancel()
        await self.layer_leave(self.group)
        await on_control_threads(bridge.connection_daemon_disconnected)(connection_id=self.connection_id,
                                                                        socket=self.channel_name)

    async def receive(self, text_data=None, bytes_data=None):
        if self.connection_id is None:
            return  # refused at connect; the close is on its way
        try:
            message = protocol.decode(text_data if text_data is not None else bytes_data)
        except ValueError as exc:
            return await self._send({"type": protocol.ERROR, "code": "bad_request", "message": str(exc)})
        kind = message["type"]
        if kind not in daemon_schemas.FRAMES:
            return await self._send({"type": protocol.ERROR, "code": "bad_request", "message": f"unknown type {kind!r}"})
        try:
            # Every frame is validated before anything of it is stored (issue 7 item 13); a frame that
            # does not validate, or that a service refuses, is answered with an error frame and the
            # socket stays up.
            frame = daemon_schemas.validated(daemon_schemas.FRAMES[kind], message)
        except ApplicationError as error:
            return await self._refused(kind, error)
        if kind == protocol.HEARTBEAT:
            # Written at once on the liveness threads; the rest of it (reconcile of the turns it
            # lists) goes with the other frames.
            spool = frame.spool.model_dump(mode="json") if frame.spool is not None else None
            self.seen_written_at = time.monotonic()
            await on_liveness_threads(bridge.connection_seen)(connection_id=self.connection_id, spool=spool)
        else:
            self._seen()
        self.frames.put_nowait((kind, frame))

    def _seen(self) -> None:
        """Any frame shows the daemon alive: its presence is written (off this socket's way)."""
        now = time.monotonic()
        if now - self.seen_written_at < SEEN_WRITE_S:
            return
        self.seen_written_at = now
        write = asyncio.ensure_future(on_liveness_threads(bridge.connection_seen)(connection_id=self.connection_id))
        write.add_done_callback(lambda done: done.cancelled() or done.exception() is None or log.warning(
            "presence of %s not written: %r", self.connection_id, done.exception()))

    async def _refused(self, kind: str, error: ApplicationError):
        await self._send({"type": protocol.ERROR, "code": error.code, "message": error.message,
                          "detail": error.detail, "in_reply_to": kind})

    async def _handle_frames(self):
        """This socket's frames in the order they came (None: the socket closed)."""
        while True:
            item = await self.frames.get()
            if item is None:
                return
            kind, frame = item
            try:
                await self._handle(kind, frame)
            except ApplicationError as error:
                await self._refused(kind, error)
            except Exception:  # noqa: BLE001 — one frame's failure must not stop the next ones
                log.exception("daemon %s: handling a %s frame failed", self.connection_id, kind)

    async def _handle(self, kind: str, frame):
        cid = self.connection_id
        spool = frame.spool.model_dump(mode="json") if getattr(frame, "spool", None) is not None else None
        if kind == protocol.HEARTBEAT:
            running = None if frame.running is None else [str(turn) for turn in frame.running]
            await on_control_threads(bridge.connection_heartbeat)(connection_id=cid, spool=spool, running=running)
            if frame.activity is not None:
                await on_control_threads(stalls.connection_store_activity)(
                    connection_id=cid, activity=[item.model_dump(mode="json") for item in frame.activity])
        elif kind == protocol.HELLO:
            hello = frame.model_dump(mode="json", exclude_none=True)
            await on_control_threads(bridge.connection_daemon_connected)(connection_id=cid, hello=hello)
            await self.commands_push({})
        elif kind == protocol.SNAPSHOT:
            running = frame.model_dump(mode="json")["running"]
            queued = None if frame.queued is None else [str(turn) for turn in frame.queued]
            await on_control_threads(bridge.connection_store_snapshot)(connection_id=cid, running=running,
                                                                       queued=queued)
            if spool is not None:
                await on_control_threads(bridge.connection_store_spool_health)(connection_id=cid, spool=spool)
        elif kind == protocol.ACK:
            await on_control_threads(bridge.command_acked)(connection_id=cid, command_id=frame.command)
        elif kind == protocol.RESULT:
            await on_control_threads(bridge.command_result)(connection_id=cid, command_id=frame.command,
                                                            result=frame.result)

    async def commands_push(self, event):
        """Deliver every pending command (also after a reconnect: they were persisted first)."""
        for command in await on_control_threads(bridge.commands_to_deliver)(connection_id=self.connection_id):
            await self._send(command)

    async def _send(self, message: dict):
        await self.send(text_data=protocol.encode(message))
