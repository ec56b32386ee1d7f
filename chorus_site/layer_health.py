"""Noticing a broken channel layer (issue 7, SPEC §10): the log is the truth, the layer a wake-up.

When Redis restarts it comes back empty: every group membership is gone, so a follower whose
receive happens to work again would never be woken again — silently.  The first layer call in a
process that fails (a receive, a ``group_add``) is therefore reported here with ``failed()``, and
every follower in the process learns of it through ``changed()``/``generation``:

* a browser's ``/ws/live/`` consumer closes its socket with ``LAYER_LOST_CLOSE`` (the client
  reconnects and resumes every stream from its cursor, ``live.catch_up``);
* the daemon's consumer keeps serving its socket (heartbeats and reports need only the database,
  commands are also polled from it) and re-joins its group once the layer answers again;
* an SSE stream keeps its heartbeat and reads the log by cursor until it can re-join.

``LayerAwareConsumer`` replaces channels' ``AsyncConsumer.__call__``: there, a layer error raised
by ``channel_layer.receive`` inside ``await_many_dispatch`` ends the consumer, and daphne may reap
it without closing the socket.  Here the error becomes a ``layer.failed`` message dispatched to
the consumer's ``layer_failed`` handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref

from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.layers import get_channel_layer
from channels.utils import await_many_dispatch

log = logging.getLogger(__name__)

# WebSocket close code for "the live channel broke; reconnect and resume from your cursor"
# (application range 4000-4999, after HTTP 503; autobahn refuses the 1012/1013 codes).
LAYER_LOST_CLOSE = 4503
# Layer calls made on behalf of one client (join, leave) give up after this long.
LAYER_CALL_TIMEOUT_S = 5.0
# How often each process checks that Redis still holds what it held (see LayerHealth.watch).
WATCH_S = 2.0
# A watchdog read slower than this means Redis hangs: a failure like any other.
WATCH_TIMEOUT_S = 5.0


class LayerHealth:
    """Process-wide: how many times the channel layer was seen failing, and who waits to know."""

    def __init__(self):
        self.generation = 0
        self._waiters: set[asyncio.Future] = set()
        self._watchdogs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> (layer, task)

    def failed(self, error: BaseException | None, where: str) -> None:
        self.generation += 1
        log.warning("channel layer failed in %s (generation %d): %r", where, self.generation, error)
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            try:
                waiter.get_loop().call_soon_threadsafe(_resolve, waiter, self.generation)
            except RuntimeError:  # its event loop is closed
                pass

    def changed(self) -> asyncio.Future:
        """A future resolved at the next ``failed()`` (cancel it when no longer interested)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        waiter.add_done_callback(self._waiters.discard)
        return waiter

    def watch(self, layer) -> None:
        """Start this event loop's watchdog of ``layer`` once (a Redis layer only).

        A Redis that restarts between two reads, or is flushed, raises nothing anywhere: every
        group is gone and every follower silently deaf.  The watchdog keeps a marker key in
        Redis; when the marker changes or vanishes, Redis lost its data and ``failed()`` is
        called, as for an error.  (With a sharded layer only the first host is watched.)
        """
        if not callable(getattr(layer, "connection", None)) or not getattr(layer, "hosts", None):
            return  # the in-memory layer cannot lose its groups behind the process' back
        loop = asyncio.get_running_loop()
        watched, task = self._watchdogs.get(loop, (None, None))
        if task is not None and not task.done():
            if watched is layer:
                return
            task.cancel()  # the layer was replaced (settings changed): watch the new one
        self._watchdogs[loop] = (layer, loop.create_task(self._watch(layer)))

    async def _watch(self, layer) -> None:
        key = f"{layer.prefix}:chorus-epoch"
        mine, known = uuid.uuid4().hex, None
        me = asyncio.current_task()
        while True:
            if me.cancelling():
                raise asyncio.CancelledError  # a cancellation swallowed inside a redis call
            try:
                redis = layer.connection(0)
                # The layer's connections have no socket timeout (see settings._layer_redis): a
                # Redis that hangs without closing TCP is noticed here, by this bound.
                created = await asyncio.wait_for(redis.set(key, mine, nx=True), WATCH_TIMEOUT_S)
                current = await asyncio.wait_for(redis.get(key), WATCH_TIMEOUT_S)
                if known is not None and (created or current != known):
                    self.failed(RuntimeError("Redis lost its data (restarted or flushed)"), "watch")
                known = current
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if known is not None:
                    self.failed(exc, "watch")
                known = None  # whoever joins after Redis is back joins the new one
            await asyncio.sleep(WATCH_S)


def _resolve(waiter: asyncio.Future, generation: int) -> None:
    if not waiter.done():
        waiter.set_result(generation)


health = LayerHealth()


async def layer_call(coroutine, where: str, *, report: bool = True) -> bool:
    """Await one layer call (join/leave/send); on error answer False and, if ``report``, tell
    every follower of the process (a failed join means the layer is broken; a failed leave does
    not matter to anyone: the membership expires with the group)."""
    try:
        await asyncio.wait_for(coroutine, timeout=LAYER_CALL_TIMEOUT_S)
        return True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # redis errors, timeouts, closed pools: all mean "no layer now"
        if report:
            health.failed(exc, where)
        else:
            log.info("channel layer %s failed: %r", where, exc)
        return False


async def receive_or_failure(layer, channel: str, *, since: int, timeout: float | None = None):
    """``(message, ok)``: a message (None on timeout), ``ok`` False once the layer has failed.

    ``since`` is the generation at which the caller joined its groups: a failure seen by any
    follower of this process after that means those groups may be gone.
    """
    if health.generation != since:
        return None, False
    receiving = asyncio.ensure_future(layer.receive(channel))
    changed = health.changed()
    try:
        await asyncio.wait({receiving, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        changed.cancel()
        if not receiving.done():
            receiving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiving
    if receiving.done() and not receiving.cancelled():
        error = receiving.exception()
        if error is None:
            return receiving.result(), True
        health.failed(error, "receive")
        return None, False
    return None, health.generation == since


class LayerAwareConsumer:
    """Mixin (first in the bases) for async consumers that follow the channel layer.

    Subclasses define ``layer_failed(message)`` (what to do once the layer broke) and may define
    ``layer_recover()``: awaited, instead of a layer receive, while ``layer_lost`` is set; it
    returns the next message to dispatch.  The default waits until the consumer ends.
    """

    layer_lost = False
    layer_generation = 0

    async def __call__(self, scope, receive, send):
        # As channels.consumer.AsyncConsumer.__call__, with the layer receive made failure-aware.
        self.scope = scope
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        self.layer_generation = health.generation
        self.base_send = send
        sources = [receive]
        if self.channel_layer is not None:
            health.watch(self.channel_layer)
            self.channel_name = await self.channel_layer.new_channel()
            self.channel_receive = self._layer_receive
            sources.append(self._layer_receive)
        self.local_inbox = asyncio.Queue()  # messages from this process (chorus_site.live.LocalFanout)
        sources.append(self.local_inbox.get)
        try:
            await await_many_dispatch(sources, self.dispatch)
        except StopConsumer:
            pass

    async def dispatch(self, message):
        """As channels' ``AsyncConsumer.dispatch`` without its ``aclose_old_connections()`` before
        every handler: a hop to the one shared sync thread per message (23 % of a busy fan-out loop,
        issue 9).  Our handlers touch the database only through ``database_sync_to_async``, which
        closes old connections around each call itself."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def _layer_receive(self):
        while True:
            if self.layer_lost:
                return await self.layer_recover()
            message, ok = await receive_or_failure(self.channel_layer, self.channel_name, since=self.layer_generation)
            if not ok:
                self.layer_lost = True
                return {"type": "layer.failed"}
            if message is not None:
                return message

    async def layer_join(self, group: str) -> bool:
        """``group_add`` that reports failure (and sets ``layer_lost``) instead of raising."""
        if self.layer_lost:
            return False
        if await layer_call(self.channel_layer.group_add(group, self.channel_name), "group_add"):
            return True
        self.layer_lost = True
        return False

    async def layer_leave(self, group: str) -> None:
        if not self.layer_lost:
            await layer_call(self.channel_layer.group_discard(group, self.channel_name), "group_discard",
                             report=False)

    async def layer_recover(self):
        await asyncio.Future()  # never: the consumer is closing
