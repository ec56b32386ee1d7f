"""Chorus Ops settings: one file, driven by the environment.

Every value read from the environment goes through a strict helper: a malformed value stops
start-up with a message naming the variable, instead of silently falling back to a default.

Embedded mode (the default): no DATABASE_URL → SQLite under CHORUS_DATA_DIR; no REDIS_URL →
in-memory channel layer and Celery tasks run in-process.  Production mode: set both.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured
from csp.constants import NONCE as CSP_NONCE

from agents import protocol as _protocol

BASE_DIR = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- strict env helpers
def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = env_str(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = env_str(name)
    if raw is None:
        return default
    items = [item.strip() for item in raw.split(",")]
    if any(not item for item in items):
        raise ImproperlyConfigured(f"{name}={raw!r} has an empty entry (comma-separated list expected)")
    return items


def parse_database_url(url: str) -> dict:
    """postgres://user:password@host:port/name?sslmode=require → Django DATABASES entry."""
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ImproperlyConfigured(
            f"DATABASE_URL scheme {parts.scheme!r} is not supported (use postgres://; unset it for SQLite)"
        )
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ImproperlyConfigured("DATABASE_URL has no database name (postgres://user@host:5432/NAME)")
    try:
        port = parts.port
    except ValueError:
        raise ImproperlyConfigured("DATABASE_URL has a malformed port") from None
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(port or ""),
        "OPTIONS": {**dict(parse_qsl(parts.query)), **database_pool_options()},
        "CONN_MAX_AGE": env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0),
        # A pooled connection is checked when taken from the pool (psycopg_pool does not); a server
        # restarted under the pool costs one reconnect, not one failed request per pooled connection.
        "CONN_HEALTH_CHECKS": True,
        "ATOMIC_REQUESTS": False,
    }


def database_pool_options() -> dict:
    """A psycopg connection pool per process (Django's OPTIONS["pool"]; issue 9 item 5).

    Under ASGI every request runs in a thread and context of its own, so CONN_MAX_AGE cannot keep a
    connection between requests: without a pool each request opened a new one (4-6 % of a list
    request in py-spy here, 10-12 % in the issue's runs). The pool keeps at most DATABASE_POOL_MAX_SIZE connections per process (a
    request waits up to DATABASE_POOL_TIMEOUT_S for one, then fails), so N processes hold at most
    N x max connections of the server's max_connections (docs/deployment.md). 0 turns it off.
    """
    max_size = env_int("DATABASE_POOL_MAX_SIZE", 4, minimum=0)
    if max_size == 0:
        return {}
    if env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0):
        raise ImproperlyConfigured("DATABASE_CONN_MAX_AGE must be 0 with the pool (DATABASE_POOL_MAX_SIZE=0 "
                                   "turns the pool off)")
    return {"pool": {
        "min_size": min(env_int("DATABASE_POOL_MIN_SIZE", 1, minimum=0), max_size),
        "max_size": max_size,
        "timeout": env_int("DATABASE_POOL_TIMEOUT_S", 10, minimum=1),
        "max_idle": 300,  # idle connections above min_size go back to the server after 5 minutes
        "max_lifetime": 1800,
    }}


def parse_redis_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in {"redis", "rediss"} or not parts.hostname:
        raise ImproperlyConfigured(f"REDIS_URL={url!r} is not a redis:// or rediss:// URL with a host")
    return url


# ---------------------------------------------------------------- core
DATA_DIR = Path(env_str("CHORUS_DATA_DIR", str(BASE_DIR / "var")))
DATABASE_URL = env_str("DATABASE_URL")
REDIS_URL = parse_redis_url(env_str("REDIS_URL")) if env_str("REDIS_URL") else None
EMBEDDED = DATABASE_URL is None

DEBUG = env_bool("DJANGO_DEBUG", False)


def _secret_key() -> str:
    configured = env_str("DJANGO_SECRET_KEY")
    if configured:
        return configured
    if not EMBEDDED:
        raise ImproperlyConfigured("DJANGO_SECRET_KEY must be set when DATABASE_URL is set (production mode)")
    # Embedded mode keeps a generated key beside its SQLite file so logins survive restarts.
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    key_file = DATA_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

# HTTPS hardening: on by default outside embedded mode (DJANGO_HTTPS=0 turns the defaults off, e.g.
# for tests over plain HTTP); each setting also has its own switch.
_https_default = env_bool("DJANGO_HTTPS", not EMBEDDED and not DEBUG)
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", _https_default)
SESSION_COOKIE_SECURE = env_bool("DJANGO_SESSION_COOKIE_SECURE", _https_default)
CSRF_COOKIE_SECURE = env_bool("DJANGO_CSRF_COOKIE_SECURE", _https_default)
SECURE_HSTS_SECONDS = env_int("DJANGO_SECURE_HSTS_SECONDS", 31536000 if _https_default else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", _https_default)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", _https_default)
if env_bool("DJANGO_BEHIND_TLS_PROXY", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_filters",
    "ninja",  # only for its bundled Swagger UI assets: /api/v1/docs loads nothing from a CDN
    "axes",  # admin login lockout (AXES_* below)
    "csp",  # Content-Security-Policy nonces in templates (CONTENT_SECURITY_POLICY below)
    "channels",
    "chorus_site",
    "sessions_app",
    "executions",
    "chorus_site.notifications",  # issue 12: rules, deliveries (docs/alerts.md); app label "notifications"
    "agents",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "chorus_site.api_input.ApiErrorBodyMiddleware",  # /api/ errors always the §8 JSON body, never HTML
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",  # last: turns a lockout into its 429 answer
]

# Content-Security-Policy (django-csp): scripts and styles only from this origin (the admin's and
# ours are static files; Swagger UI is django-ninja's bundled copy), WebSockets to this origin
# ('self' covers ws:/wss: of the same host), no framing, no plugins.  A template that truly needs
# an inline script gives it nonce="{{ request.csp_nonce }}".
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'", CSP_NONCE],  # the nonce is only sent when a template used it
        "style-src": ["'self'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

# ---------------------------------------------------------------- brute force (issue 8 item 8)
# Admin login: django-axes locks a username from one IP address out after AXES_FAILURE_LIMIT
# failed logins, for AXES_COOLOFF_TIME (429 "Account locked"); a successful login resets the count.
# An ops admin can unlock earlier: `manage.py axes_reset_username <name>` or the Axes admin pages.
# The model backend reads a user's permissions in one query instead of two (issue 9: the API answers
# 2 statements per list request, not 5).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "chorus_site.permissions.OneQueryModelBackend"]
AXES_FAILURE_LIMIT = env_int("CHORUS_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("CHORUS_LOGIN_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False


def env_rate(name: str, default: str) -> str:
    """A throttle rate "<count>/<s|min|h|day>", e.g. "20/min"."""
    value = env_str(name, default)
    if not re.fullmatch(r"[1-9][0-9]*/(s|sec|m|min|h|hour|d|day)", value):
        raise ImproperlyConfigured(f"{name}={value!r} is not a rate like 20/min")
    return value


# API: requests per authenticated caller (django-ninja throttling; 429 with Retry-After), and
# failed credential checks (API tokens, task tokens, connection keys) per client address and
# credential, and per address, after which checks are refused until the window passes
# (chorus_site/throttling.py).
CHORUS_API_RATE = env_rate("CHORUS_API_RATE", "1200/min")
CHORUS_CREDENTIAL_FAILURE_RATE = env_rate("CHORUS_CREDENTIAL_FAILURE_RATE", "20/min")  # per address + credential
CHORUS_ADDRESS_FAILURE_RATE = env_rate("CHORUS_ADDRESS_FAILURE_RATE", "100/min")  # per address
# The client address is REMOTE_ADDR only: an X-Forwarded-For header is the client's to forge
# (it would dodge every counter). Behind a proxy, daphne's --proxy-headers sets REMOTE_ADDR.
NINJA_NUM_PROXIES = 0

ROOT_URLCONF = "chorus_site.urls"
ASGI_APPLICATION = "chorus_site.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

if EMBEDDED:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "chorus.sqlite3",
            # WAL lets the web server, task runner and daemon API read while one writes.
            "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL;", "transaction_mode": "IMMEDIATE", "timeout": 20},
        }
    }
else:
    DATABASES = {"default": parse_database_url(DATABASE_URL)}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("DJANGO_STATIC_ROOT", str(DATA_DIR / "static")))
STATICFILES_DIRS = [BASE_DIR / "chorus_site" / "static"]
# Embedded mode serves static files from the ASGI app itself; production puts a proxy in front.
CHORUS_SERVE_STATIC = env_bool("CHORUS_SERVE_STATIC", EMBEDDED or DEBUG)

LOGIN_URL = "admin:login"

# ---------------------------------------------------------------- channels
def _layer_redis(url: str) -> dict:
    """redis-py options of the channel layer, chosen for a Redis that dies or restarts empty.

    The layer is a wake-up only (the event log is the truth): a failure must surface quickly to
    the followers, which close or fall back to the log (chorus_site/layer_health.py), never hang.
    """
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return {
        "address": url,
        # No socket timeout: on Python 3.11 redis-py's read timeout (asyncio.timeout) can swallow a
        # cancellation that arrives during a read, and channels_redis then loops in its blocking
        # BZPOPMIN forever, so a consumer never finishes (its socket close hangs, and so does the
        # event loop's shutdown).  A Redis that hangs without closing TCP is noticed instead by the
        # process' layer watchdog (chorus_site/layer_health.py, a bounded read every 2 s), which
        # tells every follower; keepalive catches a dead peer.
        "socket_timeout": None,
        # Broadcasts run after commit inside requests: an unreachable Redis must fail fast.
        "socket_connect_timeout": 2,
        "socket_keepalive": True,
        # No retry on timeout: a timeout means Redis hung; retrying would hide it from followers.
        "retry_on_timeout": False,
        # One immediate retry on a connection error: a pooled connection left from before a Redis
        # restart fails once and is replaced, instead of failing a broadcast or a join (and making
        # every follower of the process reconnect once more).  A Redis really down still fails.
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        # PING a pooled connection idle for 5 s before using it (with the retry: replaced if stale).
        "health_check_interval": 5,
    }


# Django's cache holds the throttle counters (chorus_site/throttling.py). Outside embedded mode the
# portal processes share them in Redis (chorus_site/cache.py: local memory while Redis fails);
# embedded mode is one process and keeps the default local-memory cache.
if REDIS_URL and not EMBEDDED:
    CACHES = {"default": {
        "BACKEND": "chorus_site.cache.SharedCache", "LOCATION": REDIS_URL, "KEY_PREFIX": "chorus-cache",
        "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
    }}

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [_layer_redis(REDIS_URL)], "capacity": 1000, "expiry": 30},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# ---------------------------------------------------------------- celery
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_ALWAYS_EAGER = REDIS_URL is None  # embedded: the in-process task runner
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Longest countdown/ETA enqueued (chorus_site.scheduling.run_later): a stop deadline is the
# connection's sigint_timeout_s + 5 s; anything longer is left to the periodic sweep.
CHORUS_ETA_MAX_S = env_int("CHORUS_ETA_MAX_S", 300, minimum=10)
# Redis keeps a message a worker took (ETA messages are taken at once and held until due) in its
# "unacked" hash; if that worker is SIGKILLed the message comes back only after visibility_timeout.
# It must exceed the longest ETA (CHORUS_ETA_MAX_S) plus the longest task (ticks and sweeps take
# seconds; the hourly purge minutes at worst), or Redis hands a message still held or running to a
# second worker.  It is no recovery mechanism: every deadline and tick is found again from the
# database by the sweeps below within one beat, so a lost message costs one sweep interval, and a
# late redelivery finds nothing left to do (tasks are safe to run twice).
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 900}
# Redis connection options of the broker (keys added to the transport options above): a Redis
# that is killed, restarted empty or hangs must cost a reconnect, never a stuck or dead worker.
CELERY_BROKER_TRANSPORT_OPTIONS.update({
    # kombu's BRPOP waits 1 s; a publish or ack on a hung Redis gives up after 10 s instead of never.
    "socket_timeout": 10,
    "socket_connect_timeout": 3,
    "socket_keepalive": True,
    # A timed-out command is retried once on a new connection (a publish may then be delivered
    # twice: every task is safe to run twice, STYLE.md).
    "retry_on_timeout": True,
    # kombu's own check of its long-lived BRPOP/pub-sub connections (default 25 s): a worker on a
    # half-open connection reconnects within about 1 + 2 × 10 s.
    "health_check_interval": 10,
})
# Keep reconnecting however long Redis is away (the default gives up after 100 attempts and the
# worker exits); the supervisor (docs/deployment.md) restarts a worker that dies anyway.
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
# A sweep not run within a minute is superseded by a later one: a worker back after an outage (or a
# backlog) runs the latest sweeps, not every one beat sent meanwhile.
CHORUS_SWEEP_EXPIRES_S = 60
CELERY_BEAT_SCHEDULE = {
    "purge-expired-events": {"task": "chorus_site.tasks.events_purge_expired", "schedule": 3600.0},
    "sweep-stale-connections": {"task": "sessions_app.tasks.connections_sweep", "schedule": 5.0,
                                "options": {"expires": CHORUS_SWEEP_EXPIRES_S}},
    "tick-waiting-runs": {"task": "executions.tasks.runs_tick_waiting", "schedule": 5.0,
                          "options": {"expires": CHORUS_SWEEP_EXPIRES_S}},
    # Notification rules (chorus_site/notifications/rules.py): new events are matched this often.
    "scan-notifications": {"task": "chorus_site.notifications.tasks.notifications_scan",
                           "schedule": float(env_int("CHORUS_NOTIFY_SCAN_S", 5, minimum=1)),
                           "options": {"expires": CHORUS_SWEEP_EXPIRES_S}},
    # Stall detection (sessions_app/stalls.py): a stalled turn is flagged within its threshold + this.
    "sweep-stalled-turns": {"task": "sessions_app.tasks.turns_stall_sweep",
                            "schedule": float(env_int("CHORUS_STALL_SWEEP_S", 5, minimum=1)),
                            "options": {"expires": CHORUS_SWEEP_EXPIRES_S}},
}

# ---------------------------------------------------------------- chorus
CHORUS_EVENT_RETENTION_DAYS = env_int("CHORUS_EVENT_RETENTION_DAYS", 7, minimum=1)
CHORUS_SSE_HEARTBEAT_S = env_int("CHORUS_SSE_HEARTBEAT_S", 15, minimum=1)
# Open WebSocket and SSE streams re-check their holder's access this often (role removed, user
# deactivated, login session deleted, token revoked → the stream closes).
CHORUS_ACCESS_RECHECK_S = env_int("CHORUS_ACCESS_RECHECK_S", 5, minimum=1)
# The one staleness threshold of daemon heartbeats: past it a connection is not live (no new work,
# evidence for mark-interrupted) and the sweep takes it offline and settles its turns.
# A portal process keeps its presence row fresh (chorus_site/presence.py): the stale sweep judges
# no daemon while no portal could hear it. Off only in a process that imports the ASGI app but
# serves no daemons (the test process: tests/conftest.py).
CHORUS_PORTAL_PRESENCE = env_bool("CHORUS_PORTAL_PRESENCE", True)
CHORUS_HEARTBEAT_TIMEOUT_S = env_int("CHORUS_HEARTBEAT_TIMEOUT_S", _protocol.HEARTBEAT_TIMEOUT_S, minimum=10)
CHORUS_IDEMPOTENCY_TTL_HOURS = 24
# /metrics (chorus_site/metrics.py, docs/alerts.md): a scraper shows this bearer token or comes from
# an allowed address or network; with neither set, /metrics answers 404.
CHORUS_METRICS_TOKEN = env_str("CHORUS_METRICS_TOKEN", "") or ""
CHORUS_METRICS_ALLOWLIST = env_list("CHORUS_METRICS_ALLOWLIST", [])
for _entry in CHORUS_METRICS_ALLOWLIST:
    try:
        ipaddress.ip_network(_entry, strict=False)
    except ValueError:
        raise ImproperlyConfigured(f"CHORUS_METRICS_ALLOWLIST: {_entry!r} is not an address or network") from None
# Notifications (chorus_site/notifications/, docs/alerts.md): links in them start with CHORUS_PUBLIC_URL (the
# portal's address as people reach it); a failed delivery is retried this many times, after
# CHORUS_NOTIFY_RETRY_S, then twice that, ...; email goes through Django's SMTP backend.
CHORUS_PUBLIC_URL = env_str("CHORUS_PUBLIC_URL", "") or ""
CHORUS_NOTIFY_RETRIES = env_int("CHORUS_NOTIFY_RETRIES", 3, minimum=0)
CHORUS_NOTIFY_RETRY_S = env_int("CHORUS_NOTIFY_RETRY_S", 30, minimum=0)
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "") or ""
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "") or ""
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = 10
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "chorus@localhost")
# A running turn silent this long is flagged stalled, unless its connection or its backend
# (sessions_app.BackendSetting, in the admin) says otherwise (docs/alerts.md).
CHORUS_STALL_THRESHOLD_S = env_int("CHORUS_STALL_THRESHOLD_S", 600, minimum=1)
# The largest prompt (or resume/hand-off context) accepted, in bytes of UTF-8: it travels to the
# daemon in one WebSocket frame, and a command larger than agents.protocol.COMMAND_MAX_BYTES is
# never sent (its turn settles with a wake error).  Larger requests answer 413.
CHORUS_PROMPT_MAX_BYTES = env_int("CHORUS_PROMPT_MAX_BYTES", 256 * 1024, minimum=1024)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("CHORUS_LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}, "celery.app.trace": {"level": "WARNING"},
                "axes": {"level": "WARNING"}},
}
