"""Throttle counters are shared by every portal process outside embedded mode (issue 8 item 8).

With Django's default local-memory cache each process counted on its own: N portal processes let
a guesser make N × the allowed failed credential checks.  Outside embedded mode the counters live
in Redis (chorus_site/cache.py), and a Redis that fails leaves the API working (local counting).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.cache import cache

from chorus_site.cache import SharedCache
from chorus_site.errors import ApplicationError
from chorus_site.throttling import credential_gate

ROOT = Path(__file__).resolve().parents[2]


def _in_another_process(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + code], cwd=ROOT, text=True,
                          capture_output=True, timeout=60,
                          env={**os.environ, "DJANGO_SETTINGS_MODULE": "chorus_site.settings", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_failed_checks_counted_in_another_process_refuse_here():
    assert settings.CACHES["default"]["BACKEND"] == "chorus_site.cache.SharedCache"
    credential_gate("10.77.0.1", "cho_guessed_secret")  # nothing counted yet
    limit = int(settings.CHORUS_CREDENTIAL_FAILURE_RATE.split("/")[0])
    _in_another_process("from chorus_site.throttling import credential_failed\n"
                        f"for _ in range({limit}): credential_failed('10.77.0.1', 'cho_guessed_secret')")
    with pytest.raises(ApplicationError) as refused:
        credential_gate("10.77.0.1", "cho_guessed_secret")
    assert refused.value.status == 429 and refused.value.detail["retry_after_s"] >= 1


def test_clearing_the_cache_leaves_the_rest_of_the_redis_database():
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.set("not-the-cache:marker", "1", ex=60)
    cache.set("counter", [1.0], 60)
    cache.clear()
    assert cache.get("counter") is None
    assert client.get("not-the-cache:marker") == b"1"  # Celery's and the channel layer's keys stay
    client.delete("not-the-cache:marker")


def test_a_redis_that_fails_leaves_counting_to_the_process():
    unreachable = SharedCache("redis://127.0.0.1:1/0", {"KEY_PREFIX": "x", "OPTIONS": {"socket_connect_timeout": 1}})
    unreachable.set("k", [1.0], 60)
    assert unreachable.get("k") == [1.0] and unreachable.failing


def test_embedded_mode_keeps_the_local_memory_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()\nfrom django.conf import settings\n"
                           "print(settings.CACHES['default']['BACKEND'])"], cwd=ROOT, text=True, capture_output=True,
                          timeout=60, env={**env, "DJANGO_SETTINGS_MODULE": "chorus_site.settings",
                                           "CHORUS_DATA_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "django.core.cache.backends.locmem.LocMemCache"
