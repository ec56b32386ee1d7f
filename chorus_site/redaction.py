"""Secret masking applied before diagnostics, events and exports are stored (SPEC §7).

Covers API keys of the common providers, bearer tokens, passwords in URLs, private key blocks,
values of variables named like KEY/TOKEN/SECRET/PASSWORD, and base64 forms of all of these:
a base64 blob is decoded and masked whole when its decoded text holds a secret, and the
base64 encodings of every secret found in clear are masked wherever they appear.
"""

from __future__ import annotations

import base64
import binascii
import re

MASK = "[REDACTED]"

_SECRET_NAME = r"[A-Za-z0-9_.-]*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|PWD|CREDENTIALS?)[A-Za-z0-9_.-]*"

# (pattern, group holding the secret or 0 for the whole match)
_PATTERNS: list[tuple[re.Pattern, int]] = [
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S), 0),
    (re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}"), 0),
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}"), 0),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), 0),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), 0),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), 0),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"), 0),
    (re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}"), 0),
    (re.compile(r"\bcho_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}"), 0),  # our own API tokens
    (re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"), 0),  # JWT
    (re.compile(r"(?i)\b(?:bearer|token|basic)\s+([A-Za-z0-9._~+/=-]{12,})"), 1),
    (re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s:/@]+:([^\s@/]+)@"), 1),  # scheme://user:PASSWORD@host
    (re.compile(rf"(?i)\b{_SECRET_NAME}\s*[:=]\s*[\"']?([^\s\"',;]{{4,}})"), 1),  # NAME=value, NAME: value
    (re.compile(rf"(?i)[\"']{_SECRET_NAME}[\"']\s*:\s*[\"']([^\"']{{4,}})[\"']"), 1),  # "name": "value"
    (re.compile(rf"(?i)--{_SECRET_NAME}[= ]([^\s\"']{{4,}})"), 1),  # --api-key=value
]

_BASE64_BLOB = re.compile(r"[A-Za-z0-9+/_-]{20,}={0,2}")


def _mask_clear(text: str, found: set[str]) -> str:
    for pattern, group in _PATTERNS:
        def replace(match: re.Match) -> str:
            secret = match.group(group)
            if not secret or secret == MASK or MASK in secret:
                return match.group(0)
            found.add(secret)
            if group == 0:
                return MASK
            start, end = match.span(group)
            base = match.start(0)
            whole = match.group(0)
            return whole[: start - base] + MASK + whole[end - base:]

        text = pattern.sub(replace, text)
    return text


def _decode_base64(blob: str) -> str | None:
    padded = blob + "=" * (-len(blob) % 4)
    for decoder in (base64.b64decode, base64.urlsafe_b64decode):
        try:
            raw = decoder(padded)
        except (binascii.Error, ValueError):
            continue
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if decoded.isprintable() or all(ch.isprintable() or ch in "\r\n\t" for ch in decoded):
            return decoded
    return None


def _base64_forms(secret: str) -> set[str]:
    """The encodings a secret takes inside a longer base64 text, at each of the three alignments.

    Character i of a base64 text carries bits [6i, 6i+6) of the bytes; only the characters whose
    bits all come from the secret are the same wherever the secret sits.
    """
    forms: set[str] = set()
    raw = secret.encode()
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + raw).decode()
        first = -(-8 * offset // 6)
        last = (8 * (offset + len(raw))) // 6
        core = encoded[first:last]
        if len(core) >= 12:
            forms.add(core)
            forms.add(core.replace("+", "-").replace("/", "_"))
    return forms


def redact(text: str | None) -> str | None:
    """Mask every secret in ``text``; idempotent."""
    if not text:
        return text
    found: set[str] = set()
    text = _mask_clear(text, found)

    def replace_blob(match: re.Match) -> str:
        blob = match.group(0)
        decoded = _decode_base64(blob)
        if decoded and _mask_clear(decoded, found) != decoded:
            return MASK
        return blob

    text = _BASE64_BLOB.sub(replace_blob, text)
    for secret in sorted(found, key=len, reverse=True):
        for form in _base64_forms(secret):
            text = text.replace(form, MASK)
    return text


def redact_data(value):
    """Redact strings nested in JSON-like data; keys named like secrets have their values masked."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [redact_data(item) for item in value]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if isinstance(key, str) and re.fullmatch(_SECRET_NAME, key, re.I) and isinstance(item, (str, int)):
                out[key] = MASK
            else:
                out[key] = redact_data(item)
        return out
    return value
