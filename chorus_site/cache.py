"""The cache that the throttle counters live in (chorus_site/throttling.py; issue 8 items 8 and 5).

Outside embedded mode several portal processes serve one site, so the counters are kept in Redis
and shared: with a cache per process, N processes would each allow the full rate (N × the failed
credential checks a guesser gets).  A Redis that is down or restarting must not take the API with
it (the event log, not Redis, is the truth, SPEC §10): while Redis fails, this cache answers from
the process' local memory (counting per process, as before) and logs it once per outage.
"""

from __future__ import annotations

import logging
import time

from django.core.cache.backends.base import DEFAULT_TIMEOUT, BaseCache
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache
from redis.exceptions import RedisError

log = logging.getLogger(__name__)


class SharedCache(BaseCache):
    """Redis (shared by every portal process), or local memory while Redis fails."""

    RETRY_S = 5.0

    def __init__(self, server, params):
        super().__init__(params)
        self.shared = RedisCache(server, params)
        self.local = LocMemCache(f"chorus-fallback-{id(self)}", params)
        self.failing, self.retry_at = False, 0.0

    def _call(self, name, *args):
        # While Redis fails it is tried again every RETRY_S only: a hung Redis costs one timeout then.
        if self.failing and time.monotonic() < self.retry_at:
            return getattr(self.local, name)(*args)
        try:
            answer = getattr(self.shared, name)(*args)
        except (RedisError, OSError) as error:
            if not self.failing:
                log.warning("shared cache unavailable (%s): counting in this process until Redis is back", error)
            self.failing, self.retry_at = True, time.monotonic() + self.RETRY_S
            return getattr(self.local, name)(*args)
        if self.failing:
            log.info("shared cache back")
            self.failing = False
        return answer

    def get(self, key, default=None, version=None):
        return self._call("get", key, default, version)

    def set(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        return self._call("set", key, value, timeout, version)

    def add(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        return self._call("add", key, value, timeout, version)

    def touch(self, key, timeout=DEFAULT_TIMEOUT, version=None):
        return self._call("touch", key, timeout, version)

    def delete(self, key, version=None):
        return self._call("delete", key, version)

    def has_key(self, key, version=None):
        return self._call("has_key", key, version)

    def incr(self, key, delta=1, version=None):
        return self._call("incr", key, delta, version)

    def get_many(self, keys, version=None):
        return self._call("get_many", keys, version)

    def set_many(self, data, timeout=DEFAULT_TIMEOUT, version=None):
        return self._call("set_many", data, timeout, version)

    def delete_many(self, keys, version=None):
        return self._call("delete_many", keys, version)

    def clear(self):
        """Only this site's keys (the prefix): the database also holds Celery's broker and the channel layer."""
        self.local.clear()
        try:
            client = self.shared._cache.get_client(write=True)
            keys = list(client.scan_iter(match=f"{self.shared.key_prefix}:*", count=1000))
            if keys:
                client.delete(*keys)
        except (RedisError, OSError):
            pass
