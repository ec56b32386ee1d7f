"""Secret masking applied before diagnostics, events and exports are stored (SPEC §7).

Covers API keys of the common providers, bearer tokens, passwords in URLs, private key blocks,
values of variables named like KEY/TOKEN/SECRET/PASSWORD, and base64 forms of all of these:
a base64 run (also wrapped over lines, misaligned, nested once, or with binary around the
secret) is decoded and masked whole when its decoded text holds a secret, and the base64
encodings of every secret found in clear are masked wherever they appear.

Ordinary operations text must come out unchanged: a name only counts as secret when its last
word is one (``API_KEY`` yes; ``KeyError``, ``sort_keys``, ``input_tokens``, ``PWD`` no), and a
value after "Bearer"/"Basic"/"token" must look random.  tests/chorus_site/test_redaction.py
holds the canaries and the texts that must not be touched.
"""

from __future__ import annotations

import base64
import binascii
import re

MASK = "[REDACTED]"

# Candidate variable names; ``_is_secret_name`` then decides (so that KeyError, sort_keys,
# input_tokens, tokenizer, PWD or KEY_FILE are left alone).
_SECRET_NAME = r"[A-Za-z0-9_.-]*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|PWD|PASSPHRASE|CREDENTIALS?)[A-Za-z0-9_.-]*"

# A name is secret when its last word (split on _ . - and camelCase) is one of these ...
_SECRET_WORDS = {
    "key", "token", "secret", "password", "passwd", "pwd", "passphrase", "credential", "credentials",
    "apikey", "accesskey", "secretkey", "privatekey", "signingkey", "encryptionkey", "masterkey", "authkey",
}
# ... or ends with one of these (compounds written as one word: githubtoken, dbpassword, clientsecret).
_SECRET_SUFFIXES = ("token", "secret", "password", "passwd", "passphrase")
# Words that may follow the secret word: SECRET_KEY_BASE, API_KEY_2.
_TRAILING_WORDS = {"base", "value", "b64", "base64"}
# The shell's working directories, not passwords.
_NOT_SECRET_NAMES = {"pwd", "oldpwd"}
# Values that are no secret whatever the name (primary_key=True, api_key = None).
_NOT_SECRET_VALUES = {"true", "false", "none", "null", "nil", "undefined", "yes", "no"}

_WORD_SPLIT = re.compile(r"[_.\-]+|(?<=[a-z0-9])(?=[A-Z])")


def _is_secret_name(name: str) -> bool:
    if name.lower() in _NOT_SECRET_NAMES:
        return False
    words = [w.lower() for w in _WORD_SPLIT.split(name) if w]
    while len(words) > 1 and (words[-1].isdigit() or words[-1] in _TRAILING_WORDS):
        words.pop()
    if not words:
        return False
    return words[-1] in _SECRET_WORDS or words[-1].endswith(_SECRET_SUFFIXES)


def _looks_random(value: str) -> bool:
    """A credential after "Bearer"/"Basic"/"token ": has a digit or an inner capital (not "authentication")."""
    return any(ch.isdigit() for ch in value) or any(ch.isupper() for ch in value[1:])


# (pattern, group holding the secret — 0 for the whole match, a tuple for alternatives: the first
# that matched —, extra check on the match or None)
_PATTERNS: list[tuple[re.Pattern, int | tuple[int, ...], object]] = [
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S), 0, None),
    (re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}"), 0, None),
    (re.compile(r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"), 0, None),  # Stripe
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}"), 0, None),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), 0, None),
    (re.compile(r"\bxox[abposre]-[A-Za-z0-9-]{10,}"), 0, None),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), 0, None),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"), 0, None),
    (re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}"), 0, None),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}"), 0, None),  # Hugging Face
    (re.compile(r"\bnpm_[A-Za-z0-9]{36}\b"), 0, None),
    (re.compile(r"\bcho_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}"), 0, None),  # our own API tokens
    (re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"), 0, None),  # JWT
    (re.compile(r"(?i)\bauthorization\s*[:=]\s*(?:(?:bearer|basic|token|bot|digest)\s+)?[\"']?([^\s\"',;]{8,})"), 1,
     lambda m: _looks_random(m.group(1))),
    (re.compile(r"(?i)\b(?:bearer|token|basic)\s+([A-Za-z0-9._~+/=-]{12,})"), 1, lambda m: _looks_random(m.group(1))),
    (re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s:/@]+:([^\s@/]+)@"), 1, None),  # scheme://user:PASSWORD@host
    # NAME="quoted value", NAME='quoted value', NAME=value / NAME: value (unquoted)
    (re.compile(rf"(?i)\b({_SECRET_NAME})\s*[:=]\s*(?:\"([^\"\n]{{4,}})\"|'([^'\n]{{4,}})'|[\"']?([^\s\"',;]{{4,}}))"),
     (2, 3, 4), lambda m: _is_secret_name(m.group(1))),
    # "name": "value", also inside JSON that was itself put in a JSON string (\"name\": \"value\")
    (re.compile(rf"(?i)\\?[\"']({_SECRET_NAME})\\?[\"']\s*:\s*\\?[\"']([^\"'\\]{{4,}})\\?[\"']"), 2,
     lambda m: _is_secret_name(m.group(1))),
    (re.compile(rf"(?i)--({_SECRET_NAME})[= ]([^\s\"']{{4,}})"), 2, lambda m: _is_secret_name(m.group(1))),  # --api-key=v
]

# Runs of base64 (standard or URL-safe alphabet), also wrapped over several lines: a line made of
# nothing but base64 continues the run above it; padding ends a run.
_BASE64_RUN = re.compile(
    r"[A-Za-z0-9+/_-]{16,}(?:[ \t]*\r?\n[ \t]*[A-Za-z0-9+/_-]{4,}(?==*[ \t]*(?:\r?\n|\Z)))*={0,2}"
)
_TO_STANDARD_ALPHABET = str.maketrans("-_", "+/")
_BASE64_DEPTH = 2  # base64 of base64 (a Kubernetes secret inside an encoded release) is still found


def _mask_clear(text: str, found: set[str]) -> str:
    for pattern, group, check in _PATTERNS:
        def replace(match: re.Match, group=group) -> str:
            if isinstance(group, tuple):
                group = next((g for g in group if match.group(g) is not None), group[0])
            secret = match.group(group)
            if not secret or secret == MASK or MASK in secret or secret.lower() in _NOT_SECRET_VALUES:
                return match.group(0)
            if check is not None and not check(match):
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


# What strings(1) would print: binary noise around a secret is dropped, and with it the cost of
# scanning a large image or archive for text.
_TEXT_SEGMENT = re.compile(r"[^\x00-\x08\x0b-\x1f\x7f\ufffd]{8,}")


def _decodings(run: str):
    """The texts a base64 run may carry: decoded from each of the four character offsets (the run
    may start mid-quantum, after a path or a dash), reduced to its printable segments."""
    compact = re.sub(r"\s+", "", run).rstrip("=").translate(_TO_STANDARD_ALPHABET)
    for offset in range(4):
        chunk = compact[offset:]
        if len(chunk) % 4 == 1:
            chunk = chunk[:-1]
        if len(chunk) < 8:
            continue
        try:
            raw = base64.b64decode(chunk + "=" * (-len(chunk) % 4), validate=True)
        except (binascii.Error, ValueError):
            continue
        text = raw.decode("utf-8", errors="replace")
        yield "\n".join(_TEXT_SEGMENT.findall(text))


_PIECE = 16  # a base64 run that decodes to this much of a secret found elsewhere is masked too


def _holds_piece_of(decoded: str, found: set[str]) -> bool:
    pieces = {secret[i:i + _PIECE] for secret in found if len(secret) >= _PIECE
              for i in range(len(secret) - _PIECE + 1)}
    return bool(pieces) and any(decoded[i:i + _PIECE] in pieces for i in range(len(decoded) - _PIECE + 1))


# Every pattern above needs one of these; one search spares decoded noise the full set.
_ANY_PATTERN_HINT = re.compile(
    r"(?i)sk-|[sr]k_|gh[pousr]_|github_pat_|xox|AKIA|ASIA|AIza|glpat-|hf_|npm_|cho_|eyJ|PRIVATE KEY|bearer|basic|://"
    r"|AUTHORIZATION|KEY|TOKEN|SECRET|PASSW|PWD|PASSPHRASE|CREDENTIAL"
)


def _holds_secret(run: str, found: set[str], depth: int) -> bool:
    for decoded in _decodings(run):
        if _ANY_PATTERN_HINT.search(decoded) and _mask_clear(decoded, found) != decoded:
            return True
        if _holds_piece_of(decoded, found):
            return True
        if depth > 1 and any(_holds_secret(inner.group(0), found, depth - 1)
                             for inner in _BASE64_RUN.finditer(decoded)):
            return True
    return False


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

    def replace_run(match: re.Match) -> str:
        run = match.group(0)
        return MASK if _holds_secret(run, found, _BASE64_DEPTH) else run

    text = _BASE64_RUN.sub(replace_run, text)
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
            if (isinstance(key, str) and isinstance(item, (str, int)) and not isinstance(item, bool)
                    and re.fullmatch(_SECRET_NAME, key, re.I) and _is_secret_name(key)):
                out[key] = MASK
            else:
                out[key] = redact_data(item)
        return out
    return value
