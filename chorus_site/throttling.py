"""Brute-force protection for credential checks and a rate limit per API caller (issue 8 item 8).

Two throttles, both django-ninja's ``SimpleRateThrottle`` (a sliding window kept in Django's cache):

- ``CallerThrottle``: every authenticated API caller (user, attempt or daemon connection) may make
  ``CHORUS_API_RATE`` requests; more are 429 with ``Retry-After``.
- ``CredentialFailures``: failed credential checks (API tokens, task tokens, connection keys, over
  HTTP and the daemon's WebSocket) are counted per client address and credential (its public part:
  ``cho_<prefix>``, ``chk_<prefix>``; ``CHORUS_CREDENTIAL_FAILURE_RATE``) and per address
  (``CHORUS_ADDRESS_FAILURE_RATE``); past either, the check is refused with 429 and ``Retry-After``
  until the window has passed — also for a correct credential, so guessing cannot continue.

The admin login is protected by django-axes (settings ``AXES_*``).  The counters live in Django's
cache: outside embedded mode Redis, shared by every portal process (chorus_site/cache.py, which
counts per process only while Redis fails); in embedded mode (one process) local memory.
"""

from __future__ import annotations

import math

from django.conf import settings
from ninja.throttling import AuthRateThrottle, BaseThrottle, SimpleRateThrottle

from .errors import ApplicationError


class CallerThrottle(AuthRateThrottle):
    scope = "caller"

    def __init__(self):
        super().__init__(rate=settings.CHORUS_API_RATE)

    def allow_request(self, request) -> bool:
        # The rate is read per request (not once at import), so a changed setting applies at once.
        self.rate = settings.CHORUS_API_RATE
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request)


class CredentialFailures(SimpleRateThrottle):
    """Failed credential checks of one key: an address, or an address and one credential's public part."""

    scope = "credential_failures"

    def __init__(self, rate: str):
        super().__init__(rate=rate)

    def get_cache_key(self, request):
        return self.key_for(client_ident(request))

    def key_for(self, ident: str) -> str:
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def retry_after(self, ident: str) -> int | None:
        """Seconds until a credential from ``ident`` is checked again; None when it may be now."""
        now = self.timer()
        history = [at for at in self.cache.get(self.key_for(ident), []) if at > now - self.duration]
        if len(history) < self.num_requests:
            return None
        return max(1, math.ceil(self.duration - (now - history[-1])))

    def record(self, ident: str) -> None:
        now = self.timer()
        key = self.key_for(ident)
        history = [at for at in self.cache.get(key, []) if at > now - self.duration]
        self.cache.set(key, [now, *history][: self.num_requests * 2], self.duration)


def client_ident(request) -> str:
    return BaseThrottle().get_ident(request) or "unknown"


def _public_part(credential: str | None) -> str:
    """What a guesser keeps fixed: ``cho_<prefix>``/``chk_<prefix>``, or a task token's signed data."""
    credential = (credential or "").strip()
    if credential.startswith("cht_"):
        return credential.split(":", 1)[0][:120]
    return "_".join(credential.split("_")[:2])[:120]


def _counters(ident: str, credential: str | None):
    # A misconfigured daemon retrying with its stale key trips only the counter of that key, not
    # its address; someone trying many different credentials trips the address's counter.
    return ((CredentialFailures(settings.CHORUS_CREDENTIAL_FAILURE_RATE), f"{ident}|{_public_part(credential)}"),
            (CredentialFailures(settings.CHORUS_ADDRESS_FAILURE_RATE), ident))


def credential_gate(ident: str, credential: str | None) -> None:
    """Refuse (429) a credential check after too many recent failures of this address or credential."""
    waits = [wait for counter, key in _counters(ident, credential) if (wait := counter.retry_after(key))]
    if waits:
        raise ApplicationError("throttled", "too many failed credential checks: retry later",
                               {"retry_after_s": max(waits)}, status=429)


def credential_failed(ident: str, credential: str | None) -> None:
    for counter, key in _counters(ident, credential):
        counter.record(key)


def bearer_of(request) -> str | None:
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else None
