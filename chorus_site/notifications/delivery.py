"""Sending one delivery: email through Django's email backend, or a signed JSON webhook.

The webhook body is the delivery's JSON payload; the receiver checks
``X-Chorus-Signature: sha256=<hex HMAC-SHA256 of "<X-Chorus-Timestamp>.<body>" with the rule's
secret>`` (``signature_valid`` is the reference) and may refuse an old timestamp (replays).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.error
import urllib.parse
import urllib.request

from django.conf import settings
from django.core.mail import EmailMessage

from .models import NotificationDelivery

WEBHOOK_TIMEOUT_S = 10


class DeliveryFailed(Exception):
    """The channel refused or could not be reached; the task retries, then logs it failed."""


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def signature_valid(secret: str, timestamp: str, body: bytes, header: str) -> bool:
    return hmac.compare_digest(signature(secret, timestamp, body), header or "")


def body_of(delivery: NotificationDelivery) -> bytes:
    return json.dumps(delivery.payload, separators=(",", ":"), sort_keys=True, default=str).encode()


def send(delivery: NotificationDelivery) -> None:
    if delivery.channel == NotificationDelivery.EMAIL:
        send_email(delivery)
    elif delivery.channel == NotificationDelivery.WEBHOOK:
        send_webhook(delivery)
    else:
        raise DeliveryFailed(f"unknown channel {delivery.channel!r}")


def send_email(delivery: NotificationDelivery) -> None:
    payload = delivery.payload
    lines = [payload.get("summary") or "", "", f"Open: {payload.get('url')}", "",
             f"Rule: {payload.get('rule')} ({payload.get('trigger')})", f"About: {payload.get('about')}",
             "", json.dumps(payload.get("facts") or {}, indent=1, sort_keys=True, default=str)]
    # One line: the summary quotes agent text, and a line break in a header is refused (BadHeaderError),
    # which would fail every retry.
    subject = " ".join(f"[Chorus] {payload.get('summary') or payload.get('rule') or ''}".split())[:160]
    message = EmailMessage(subject=subject,
                           body="\n".join(lines), from_email=settings.DEFAULT_FROM_EMAIL,
                           to=[a.strip() for a in delivery.target.split(",") if a.strip()])
    try:
        message.send(fail_silently=False)
    except Exception as exc:  # noqa: BLE001 — SMTP errors, refused connections, timeouts
        raise DeliveryFailed(f"email: {exc.__class__.__name__}: {exc}"[:500]) from exc


def send_webhook(delivery: NotificationDelivery) -> None:
    body = body_of(delivery)
    timestamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", "User-Agent": "chorus-ops-notifications",
               "X-Chorus-Timestamp": timestamp, "X-Chorus-Delivery": str(delivery.pk)}
    if delivery.rule.webhook_secret:
        headers["X-Chorus-Signature"] = signature(delivery.rule.webhook_secret, timestamp, body)
    if urllib.parse.urlsplit(delivery.target).scheme not in ("http", "https"):
        raise DeliveryFailed("webhook URL is not http(s)")  # a rule saved before the admin checked it
    request = urllib.request.Request(delivery.target, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as response:
            if not 200 <= response.status < 300:
                raise DeliveryFailed(f"webhook answered HTTP {response.status}")
    except urllib.error.HTTPError as exc:
        raise DeliveryFailed(f"webhook answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise DeliveryFailed(f"webhook unreachable: {getattr(exc, 'reason', exc)}"[:500]) from exc
