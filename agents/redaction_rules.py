"""Secret masking applied before diagnostics, events and exports are stored (SPEC §7).

Shared by the daemon (which masks before it spools a report, so the spool never keeps a secret on
disk) and the portal (chorus_site.redaction, which masks again at ingestion): standard library
only, like agents.protocol.

Covers API keys of the common providers, bearer tokens, passwords in URLs, private key blocks,
values of variables named like KEY/TOKEN/SECRET/PASSWORD, and base64 forms of all of these:
a base64 run (also wrapped over lines, misaligned, nested once, or with binary around the
secret) is decoded and masked whole when its decoded text holds a secret, and the base64
encodings of every secret found in clear are masked wherever they appear.

Ordinary operations text must come out unchanged: a name only counts as secret when its last
word is one (``API_KEY`` yes; ``KeyError``, ``sort_keys``, ``input_tokens``, ``PWD`` no), and a
value after "Bearer"/"Basic"/"token" must look random.  tests/chorus_site/test_redaction.py
holds the canaries and the texts that must not be touched.

JSON-escaped text (agent CLIs print JSON lines, so text arrives with literal ``\\n`` and ``\\"``)
counts the same: a literal ``\\n`` is a word boundary and ``NAME = \\"value\\"`` is a quoted value.
Provider key formats come from gitleaks' rule list, used as data (agents/gitleaks_rules.json,
made by bench/redaction_detectors.py, which also gives the figures for choosing it); our own rules
cover what it lacks: our key formats (``chk_``, ``cho_``, ``cht_``), names like KEY/TOKEN, base64
forms, a secret wrapped onto the next line, and private keys printed line by line
(``StreamRedactor``, which keeps state across the lines of one turn's output).

Ingestion (``ingest``) also makes text storable: NUL and lone surrogates (which PostgreSQL refuses
in text and jsonb) become U+FFFD.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
from collections import Counter

MASK = "[REDACTED]"

# Candidate variable names; ``_is_secret_name`` then decides (so that KeyError, sort_keys,
# input_tokens, tokenizer, PWD or KEY_FILE are left alone).
# Bounded on both sides: with "*" a long run of word characters (a 300,000-character token
# pasted as an instruction) was scanned to its end from every position, quadratic (20,000
# characters: 3 s). A variable name is far shorter than 100 characters on each side.
_SECRET_NAME = r"[A-Za-z0-9_.-]{0,100}(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|PWD|PASSPHRASE|CREDENTIALS?)[A-Za-z0-9_.-]{0,100}"

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

# A bare "key" after one of these words names no secret (Idempotency-Key, idea_key, sort_key,
# primary_key); a bare "key" alone ("key": "build", key=value) counts only with a credential-like value.
_NOT_SECRET_KEY_WORDS = {"idempotency", "idea", "sort", "primary", "foreign", "cache", "partition", "lookup", "group",
                         "routing", "public", "object", "node", "row", "hash", "dedup", "unique", "natural", "map",
                         "dict", "composite", "index", "order", "shard", "hotkey", "task", "run", "step", "workflow"}

_WORD_SPLIT = re.compile(r"[_.\-]+|(?<=[a-z0-9])(?=[A-Z])")
# Placeholders, not values: $VAR, ${VAR}, {{ var }}, %VAR%, <token>, cho_..., ****, xxxx (as gitleaks'
# global allowlist has them).
_PLACEHOLDER = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|\{\{.*\}\}|%[A-Za-z_]+%|<[^<>]+>|.*(?:\.\.\.|…)|\*+|[xX]+|"
                          r"\[REDACTED\].*|\$\(.*\)|(?i:pass|password|passwd|secret|changeme|your[_-]?password)")


def _words(name: str) -> list[str]:
    words = [w.lower() for w in _WORD_SPLIT.split(name) if w]
    while len(words) > 1 and (words[-1].isdigit() or words[-1] in _TRAILING_WORDS):
        words.pop()
    return words


def _is_secret_name(name: str) -> bool:
    if name.lower() in _NOT_SECRET_NAMES:
        return False
    words = _words(name)
    if not words:
        return False
    return words[-1] in _SECRET_WORDS or words[-1].endswith(_SECRET_SUFFIXES)


def entropy(text: str) -> float:
    """Shannon entropy in bits per character."""
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values()) if n else 0.0


def _secret_value(name: str, value: str) -> bool:
    """A value under a secret-looking name: a bare "key" needs a credential-like value."""
    if not _is_secret_name(name):
        return False
    words = _words(name)
    if words[-1] == "key" and len(words) > 1 and words[-2] in _NOT_SECRET_KEY_WORDS:
        return False
    if words[-1] == "key" and re.fullmatch(r"\d+[/.:,][\d/.:,]{0,10}", value):
        return False  # a count or a ratio ("generic-api-key: 14/62"): no key is that
    if words[-1] == "key" and len(words) == 1:
        return (len(value) >= 16 and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)
                and entropy(value) >= 3.5)
    return True


def _looks_random(value: str) -> bool:
    """A credential after "Bearer"/"Basic"/"token ": has a digit or an inner capital (not "authentication")."""
    return any(ch.isdigit() for ch in value) or any(ch.isupper() for ch in value[1:])


# A word boundary, also right after a JSON escape (``\n``, ``\t``, ``\r`` written out in a JSON line).
_B = r"(?:(?<=\\[nrt])|\b)"
# A character of an unquoted value: stops at a JSON escape (``\n``, ``\"``) as at white space.
_V = r"(?:[^\s\"',;\\]|\\(?![nrt\"\\]))"

# (pattern, group holding the secret — 0 for the whole match, a tuple for alternatives: the first
# that matched —, extra check on the match or None).  Provider formats that gitleaks' list detects
# are left to it (see ``_GITLEAKS``); these are what it lacks on our corpus.
_OWN_FIRST: list[tuple[re.Pattern, int | tuple[int, ...], object]] = [
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|\Z)",
                re.S), 0, None),
    # our own: connection keys, API tokens, task tokens (executions/task_tokens.py: cht_ + a signed value)
    (re.compile(_B + r"chk_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}"), 0, None),
    (re.compile(_B + r"cho_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}"), 0, None),
    (re.compile(_B + r"cht_[A-Za-z0-9_.:-]{20,}"), 0, None),
]
_OWN_LAST: list[tuple[re.Pattern, int | tuple[int, ...], object]] = [
    (re.compile(_B + r"sk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}"), 0, None),  # OpenAI (also legacy), DeepSeek
    (re.compile(_B + r"xox[abposre]-[A-Za-z0-9-]{10,}"), 0, None),  # Slack (gitleaks' needs more segments)
    (re.compile(_B + r"hf_[A-Za-z0-9]{30,}"), 0, None),  # Hugging Face
    (re.compile(_B + r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"), 0, None),  # JWT
    (re.compile(rf"(?i){_B}authorization\s*[:=]\s*(?:(?:bearer|basic|token|bot|digest)\s+)?[\"']?({_V}{{8,}})"), 1,
     lambda m: _looks_random(m.group(1))),
    (re.compile(_B + r"(?i:bearer|token|basic)\s+([A-Za-z0-9._~+/=-]{12,})"), 1, lambda m: _looks_random(m.group(1))),
    (re.compile(rf"(?i){_B}[a-z][a-z0-9+.-]*://[^\s:/@\\]+:([^\s@/\\]+)@"), 1, None),  # scheme://user:PASSWORD@host
    # NAME="quoted value", NAME='quoted value', NAME=\"escaped quotes\", NAME=value / NAME: value (unquoted)
    (re.compile(rf"(?i){_B}({_SECRET_NAME})[ \t]*[:=][ \t]*(?:\"([^\"\n]{{4,}})\"|'([^'\n]{{4,}})'|\\\"([^\"\\\n]{{4,}})\\\""
                rf"|[\"']?({_V}{{4,}}))"),
     (2, 3, 4, 5), lambda m: _secret_value(m.group(1), m.group(m.lastindex))),
    # "name": "value", also inside JSON that was itself put in a JSON string (\"name\": \"value\")
    (re.compile(rf"(?i)\\?[\"']({_SECRET_NAME})\\?[\"']\s*:\s*\\?[\"']([^\"'\\]{{4,}})\\?[\"']"), 2,
     lambda m: _secret_value(m.group(1), m.group(2))),
    (re.compile(rf"(?i)--({_SECRET_NAME})[= ]({_V}{{4,}})"), 2, lambda m: _secret_value(m.group(1), m.group(2))),
]

# A literal each pattern above cannot match without (lower-cased; any one of them): a text whose
# lower-cased form has none of a pattern's literals skips that pattern (issue 9: running every
# pattern on every line was most of a report's cost).  Exact for ASCII text; a text with other
# characters runs every pattern (case-insensitive matching folds a few of them onto ASCII).
_NAME_LITERALS = ("key", "token", "secret", "password", "passwd", "pwd", "passphrase", "credential")
_OWN_FIRST_LITERALS = (("private key",), ("chk_",), ("cho_",), ("cht_",))
_OWN_LAST_LITERALS = (("sk-",), ("xox",), ("hf_",), ("eyj",), ("authorization",), ("bearer", "token", "basic"),
                      ("://",), _NAME_LITERALS, _NAME_LITERALS, _NAME_LITERALS)
assert len(_OWN_FIRST_LITERALS) == len(_OWN_FIRST) and len(_OWN_LAST_LITERALS) == len(_OWN_LAST)
_ALL_LITERALS = frozenset(lit for group in (*_OWN_FIRST_LITERALS, *_OWN_LAST_LITERALS) for lit in group)


_LAZY_PREFIX = "[\\w.-]{0,50}?"
_DOUBLED_PREFIX = _LAZY_PREFIX + "(?i:" + _LAZY_PREFIX  # five of gitleaks' generated rules start so


def _load_gitleaks() -> tuple[list, list[re.Pattern], set[str]]:
    """gitleaks' rules as data: [(id, pattern, secret group, min entropy, keywords)], its value allowlist."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gitleaks_rules.json")
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    rules = []
    for rule in data["rules"]:
        regex = rule["regex"]
        for lead in ("\\b", "(?i)\\b"):  # a JSON escape is a boundary here too
            if regex.startswith(lead):
                regex = lead[:-2] + _B + regex[len(lead):]
        # A leading lazy "[\w.-]{0,50}?" (doubled in five rules) only widens the match to the left:
        # at every position of a long run of word characters it tried 50 (2,500) splits, so a
        # 300,000-character token took minutes. Only the secret group is masked, and it is found
        # the same without it.
        for prefix, kept in ((_DOUBLED_PREFIX, "(?i:"), ("(?i)" + _LAZY_PREFIX, "(?i)"), (_LAZY_PREFIX, "")):
            if regex.startswith(prefix):
                regex = kept + regex[len(prefix):]
                break
        rules.append((rule["id"], re.compile(regex), rule["group"], rule["entropy"], frozenset(rule["keywords"])))
    keywords = tuple(sorted({k for rule in rules for k in rule[4]}))
    return rules, [re.compile(a) for a in data["allowlist"]], keywords


_GITLEAKS, _GITLEAKS_ALLOW, _GITLEAKS_KEYWORDS = _load_gitleaks()
_GITLEAKS_KEYWORD_RE = re.compile("|".join(map(re.escape, _GITLEAKS_KEYWORDS)))
_GITLEAKS_ALWAYS = tuple(i for i, rule in enumerate(_GITLEAKS) if not rule[4])  # rules without keywords
_GITLEAKS_BY_KEYWORD: dict[str, list[int]] = {}
for _index, _rule in enumerate(_GITLEAKS):
    for _keyword in _rule[4]:
        _GITLEAKS_BY_KEYWORD.setdefault(_keyword, []).append(_index)


def _masked(text: str, span: tuple[int, int], base: int = 0) -> str:
    return text[: span[0] - base] + MASK + text[span[1] - base:]


def _no_secret(secret: str | None) -> bool:
    return (not secret or secret == MASK or MASK in secret or secret.lower() in _NOT_SECRET_VALUES
            or bool(_PLACEHOLDER.fullmatch(secret)))


def _apply(patterns, text: str, found: set[str], literals=None, present=None) -> str:
    """``literals``: per pattern, those it needs (see _OWN_LAST_LITERALS); ``present``: those the
    (ASCII) text holds.  Without them every pattern runs."""
    for index, (pattern, group, check) in enumerate(patterns):
        if present is not None and present.isdisjoint(literals[index]):
            continue
        def replace(match: re.Match, group=group) -> str:
            if isinstance(group, tuple):
                group = next((g for g in group if match.group(g) is not None), group[0])
            secret = match.group(group)
            if _no_secret(secret) or (check is not None and not check(match)):
                return match.group(0)
            found.add(secret)
            return MASK if group == 0 else _masked(match.group(0), match.span(group), match.start(0))

        text = pattern.sub(replace, text)
    return text


def _keywords_in(low: str, candidates=None) -> set[str]:
    """The gitleaks keywords in ``low`` (lower-cased text), out of ``candidates`` (default: all)."""
    return {k for k in (_GITLEAKS_KEYWORDS if candidates is None else candidates) if k in low}


def _rules_for(present: set[str]) -> list[int]:
    """The indexes in ``_GITLEAKS`` (in its order) of the rules one of whose keywords is present."""
    chosen = set(_GITLEAKS_ALWAYS)
    for keyword in present:
        chosen.update(_GITLEAKS_BY_KEYWORD.get(keyword, ()))
    return sorted(chosen)


def _apply_gitleaks(text: str, found: set[str], candidates=None) -> str:
    """``candidates``: a superset of the keywords in ``text`` (a batch's, StreamRedactor.events), or None."""
    present = _keywords_in(text.lower(), candidates)  # a rule runs only when one of its keywords is there
    if not present:
        return text
    for index in _rules_for(present):
        _rule_id, pattern, group, min_entropy, _keywords = _GITLEAKS[index]

        def replace(match: re.Match, group=group, min_entropy=min_entropy) -> str:
            g = group or next((i for i in range(1, (match.lastindex or 0) + 1) if match.group(i)), 0)
            secret = match.group(g)
            if _no_secret(secret) or (min_entropy and entropy(secret) < min_entropy) \
                    or any(a.search(secret) for a in _GITLEAKS_ALLOW):
                return match.group(0)
            found.add(secret)
            return _masked(match.group(0), match.span(g), match.start(0))

        text = pattern.sub(replace, text)
    return text


# A secret cut by a line wrap: the masked part ends its line and the next line is nothing but the
# rest of it (one random-looking run).
_CONTINUATION = re.compile(r"\[REDACTED\](\r?\n|\\n)([ \t]*)([A-Za-z0-9+/_-]{4,}={0,2})(?=[ \t]*(?:\r?\n|\\[nr\"]|[\"']|\Z))")


def _continues(run: str) -> bool:
    """Random-looking rest of a secret: a digit and a letter, or case switching as in base64."""
    if any(c.isdigit() for c in run) and any(c.isalpha() for c in run):
        return True
    switches = sum(1 for a, b in zip(run, run[1:]) if a.isalpha() and b.isalpha() and a.isupper() != b.isupper())
    return switches >= 3


def _mask_continuations(text: str) -> str:
    for _ in range(8):
        new = _CONTINUATION.sub(lambda m: MASK + m.group(1) + m.group(2) + MASK if _continues(m.group(3))
                                else m.group(0), text)
        if new == text:
            break
        text = new
    return text


def _mask_clear(text: str, found: set[str], candidates=None, literals=None) -> str:
    """``candidates``/``literals``: supersets of the gitleaks keywords / our patterns' literals in
    ``text`` (a batch's, StreamRedactor.events), or None for all."""
    present = None
    if text.isascii():  # masking keeps it so (MASK is ASCII), and masking never adds a literal
        low = text.lower()
        present = {lit for lit in (_ALL_LITERALS if literals is None else literals) if lit in low}
    text = _apply(_OWN_FIRST, text, found, _OWN_FIRST_LITERALS, present)
    text = _apply_gitleaks(text, found, candidates)
    text = _apply(_OWN_LAST, text, found, _OWN_LAST_LITERALS, present)
    return _mask_continuations(text) if MASK in text else text


# Runs of base64 (standard or URL-safe alphabet), also wrapped over several lines: a line made of
# nothing but base64 continues the run above it; padding ends a run.
_BASE64_RUN = re.compile(
    r"[A-Za-z0-9+/_-]{16,}(?:[ \t]*\r?\n[ \t]*[A-Za-z0-9+/_-]{4,}(?==*[ \t]*(?:\r?\n|\Z)))*={0,2}"
)
_TO_STANDARD_ALPHABET = str.maketrans("-_", "+/")
_BASE64_DEPTH = 2  # base64 of base64 (a Kubernetes secret inside an encoded release) is still found


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


# Every pattern of ours needs one of these (gitleaks' rules name their keywords); one search
# spares decoded noise the full set.
_ANY_PATTERN_HINT = re.compile(
    r"(?i)sk-|[sr]k_|gh[pousr]_|github_pat_|xox|AKIA|ASIA|AIza|glpat-|hf_|npm_|ch[kot]_|eyJ|PRIVATE KEY|bearer|basic"
    r"|://|AUTHORIZATION|KEY|TOKEN|SECRET|PASSW|PWD|PASSPHRASE|CREDENTIAL"
)


def _may_hold_secret(decoded: str) -> bool:
    if _ANY_PATTERN_HINT.search(decoded):
        return True
    return _GITLEAKS_KEYWORD_RE.search(decoded.lower()) is not None


def _holds_secret(run: str, found: set[str], depth: int) -> bool:
    for decoded in _decodings(run):
        if _may_hold_secret(decoded) and _mask_clear(decoded, found) != decoded:
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


# Base64 runs that hold no secret (decided with nothing found in clear beside them, which then
# stays so): paths and identifiers repeat in agent output, and decoding each again was a large
# part of redacting it (issue 9).  Bounded; cleared when full.
_CLEAN_RUNS: set[str] = set()
_CLEAN_RUNS_MAX = 20000


def _remember_clean(run: str) -> None:
    if len(_CLEAN_RUNS) >= _CLEAN_RUNS_MAX:
        _CLEAN_RUNS.clear()
    _CLEAN_RUNS.add(run)


def redact(text: str | None, *, keywords=None, literals=None) -> str | None:
    """Mask every secret in ``text``; idempotent.  ``keywords``: a superset of the gitleaks
    keywords in ``text`` (see ``_apply_gitleaks``), or None for all."""
    if not text:
        return text
    found: set[str] = set()
    text = _mask_clear(text, found, keywords, literals)

    def replace_run(match: re.Match) -> str:
        run = match.group(0)
        if not found and run in _CLEAN_RUNS:
            return run
        if _holds_secret(run, found, _BASE64_DEPTH):
            return MASK
        if not found:
            _remember_clean(run)
        return run

    text = _BASE64_RUN.sub(replace_run, text)
    for secret in sorted(found, key=len, reverse=True):
        for form in _base64_forms(secret):
            text = text.replace(form, MASK)
    return text


# ---------------------------------------------------------------- ingestion
# PostgreSQL refuses NUL in text and jsonb, and a lone surrogate cannot be encoded: both become
# U+FFFD (the replacement character), so one bad byte never makes a report fail on every retry.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def clean_text(text: str) -> str:
    """``text`` with NUL and lone surrogates replaced by U+FFFD."""
    return _UNSTORABLE.sub(REPLACEMENT, text) if _UNSTORABLE.search(text) else text


def _secret_key(key, item) -> bool:
    """A value under a key named like a secret (a bare "key" only with a credential-like value:
    ``{"key": "docs"}`` names a node, ``{"key": 4711}`` an id)."""
    return (isinstance(key, str) and bool(re.fullmatch(_SECRET_NAME, key, re.I))
            and _secret_value(key, item if isinstance(item, str) else str(item)))


def redact_structure(value, *, text=None):
    """Any JSON value with every string made storable and redacted (keys too are made storable);
    keys named like secrets have their values masked.  ``text`` redacts a string (default
    ``redact``; a ``StreamRedactor`` passes its own)."""
    text = text or redact
    if isinstance(value, str):
        return text(clean_text(value))
    if isinstance(value, (list, tuple)):
        return [redact_structure(item, text=text) for item in value]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            key = clean_text(key) if isinstance(key, str) else key
            if isinstance(item, (str, int)) and not isinstance(item, bool) and _secret_key(key, item) \
                    and not (isinstance(item, str) and _no_secret(item)):
                out[key] = MASK
            else:
                out[key] = redact_structure(item, text=text)
        return out
    return value


def redact_data(value):
    """Redact strings nested in JSON-like data; keys named like secrets have their values masked."""
    return redact_structure(value)


ingest = redact_structure  # the one function every entry point applies to what it stores


_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
_PEM_END = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
_RUN_LINE = re.compile(r"[ \t]*[A-Za-z0-9+/_-]{4,}={0,2}[ \t]*")
# Fields of an agent event that carry its free text, in the order it was printed.
STREAM_FIELDS = ("text", "message")


class StreamRedactor:
    """Redacts the texts of one output stream (a turn's events) in order, with what one text
    alone cannot show: a private key printed line by line (each line its own event, so the body
    lines have no header) stays masked through its END line, and a secret cut at the end of one
    text is masked in the next when that is nothing but its rest."""

    def __init__(self):
        self.in_key = False
        self.tail_masked = False
        self.keywords = None  # while a batch is redacted: the gitleaks keywords present in it
        self.literals = None  # ... and the literals our patterns need (_ALL_LITERALS) present in it

    def _redact(self, text):
        return redact(text, keywords=self.keywords, literals=self.literals)

    def text(self, text: str) -> str:
        if not text:
            return text
        if self.in_key:
            end = _PEM_END.search(text)
            if end is None:
                return MASK
            self.in_key = False
            text = MASK + text[end.end():]
        elif self.tail_masked and _RUN_LINE.fullmatch(text) and _continues(text.strip()):
            return MASK
        out = self._redact(text)
        begins = list(_PEM_BEGIN.finditer(text))
        if begins and not _PEM_END.search(text, begins[-1].end()):
            self.in_key = True
        self.tail_masked = self.in_key or out.rstrip().endswith(MASK)
        return out

    def event(self, event):
        """An event (``{kind, data}``): its free-text fields through this stream, the rest redacted."""
        if not isinstance(event, dict):
            return redact_structure(event, text=self._redact)
        out = redact_structure({k: v for k, v in event.items() if k != "data"}, text=self._redact)
        data = event.get("data")
        if isinstance(data, dict):
            data = {clean_text(k) if isinstance(k, str) else k: v for k, v in data.items()}
            stream = {k: self.text(clean_text(v)) for k, v in data.items() if k in STREAM_FIELDS and isinstance(v, str)}
            rest = redact_structure({k: v for k, v in data.items() if k not in stream}, text=self._redact)
            out["data"] = {k: stream[k] if k in stream else rest[k] for k in data}
        elif "data" in event:
            out["data"] = redact_structure(data, text=self._redact)
        return out

    def events(self, events: list) -> list:
        """A batch, in order.  The gitleaks keywords present are looked for once in the whole batch
        (issue 9: that scan was most of the cost of a report); each text then checks only those."""
        texts: list[str] = []
        _texts_of(events, texts)
        joined = "\n".join(texts).lower()
        self.keywords = _keywords_in(joined)
        self.literals = frozenset(lit for lit in _ALL_LITERALS if lit in joined)
        try:
            return [self.event(event) for event in events]
        finally:
            self.keywords = self.literals = None


def _texts_of(value, out: list) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                out.append(key)
            _texts_of(item, out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _texts_of(item, out)
