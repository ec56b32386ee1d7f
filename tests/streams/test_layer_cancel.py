"""A follower's layer receive ends when it is cancelled (a consumer's close, the loop's shutdown).

Reproduction: with a read timeout on the layer's Redis connections, a cancellation arriving while
the connection was being set up or read was swallowed on Python 3.11, and channels_redis went on
with its blocking BZPOPMIN forever: ``tests/streams/test_live_consumer.py::test_anonymous_is_closed``
hung at teardown in about 2 runs of 3.
"""

from __future__ import annotations

import asyncio

import pytest
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from chorus_site.layer_health import health, receive_or_failure

pytestmark = pytest.mark.redis

# Early cancellations hit the connection's set-up and first read, where it was swallowed.
DELAYS_S = [0.0, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.012, 0.015, 0.02, 0.03, 0.05] * 2


@pytest.mark.parametrize("delay", DELAYS_S)
async def test_a_cancelled_receive_finishes(delay):
    config = settings.CHANNEL_LAYERS["default"]
    if "Redis" not in config["BACKEND"]:
        pytest.fail("needs the Redis channel layer (REDIS_URL)")
    layer = RedisChannelLayer(**config["CONFIG"])  # new connections, as in a new process
    channel = await layer.new_channel()
    receiving = asyncio.ensure_future(receive_or_failure(layer, channel, since=health.generation))
    await asyncio.sleep(delay)
    receiving.cancel()
    # Generous: a finished receive takes milliseconds; a swallowed cancel never finishes.
    done, _ = await asyncio.wait({receiving}, timeout=15)
    assert done, "the cancelled layer receive is still running"
    await layer.close_pools()
