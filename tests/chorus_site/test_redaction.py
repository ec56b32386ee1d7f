"""Secret masking (SPEC §7, quality target R6): a canary table and a no-false-positive table.

For every canary, the secret must not survive ``redact`` — neither in clear nor in any base64
form (at each of the three byte alignments it can take inside a longer base64 text, standard and
URL-safe alphabets).  Ordinary operations text must come out unchanged.
"""

from __future__ import annotations

import base64
import json
import random
import re
import string
import textwrap

import pytest

from chorus_site.redaction import MASK, redact, redact_data

_rng = random.Random(20240611)  # fixed: a failure names the same canary every run


def rand(n, alphabet=string.ascii_letters + string.digits):
    return "".join(_rng.choice(alphabet) for _ in range(n))


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def base64_forms(secret: str) -> set[str]:
    """Every run of base64 characters that encodes only bytes of ``secret``, at offsets 0, 1, 2."""
    forms = set()
    raw = secret.encode()
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + raw + b"\0\0\0").decode()
        first = -(-8 * offset // 6)
        last = (8 * (offset + len(raw))) // 6
        core = encoded[first:last]
        if len(core) >= 12:
            forms.add(core)
            forms.add(core.translate(str.maketrans("+/", "-_")))
    return forms


def carries(text: str, secret: str, depth: int = 3) -> bool:
    """Whether ``text`` holds ``secret`` in clear or in base64 (wrapped, nested, at any offset)."""
    if secret in text or any(form in text for form in base64_forms(secret)):
        return True
    if depth == 0:
        return False
    for run in re.findall(r"[A-Za-z0-9+/_=\n-]{16,}", text):
        compact = run.replace("\n", "").rstrip("=").translate(str.maketrans("-_", "+/"))
        for offset in range(4):
            chunk = compact[offset:]
            chunk = chunk[: len(chunk) - (len(chunk) % 4 == 1)]
            try:
                decoded = base64.b64decode(chunk + "=" * (-len(chunk) % 4)).decode("latin-1")
            except ValueError:
                continue
            if carries(decoded, secret, depth - 1):
                return True
    return False


def windows(text: str, size: int):
    return {text[i:i + size] for i in range(len(text) - size + 1)} if len(text) >= size else {text}


def assert_masked(output: str, *secrets: str):
    """Neither the secret nor its base64 survive, not even a 14-character piece of either
    (a secret cut in two by a line wrap must not leave half of it readable)."""
    for secret in secrets:
        assert secret not in output, f"secret {secret[:12]}… survived"
        for piece in windows(secret, 14):
            assert piece not in output, f"part {piece!r} of secret {secret[:12]}… survived"
        for form in base64_forms(secret):
            assert form not in output, f"base64 form of {secret[:12]}… survived"
            for piece in windows(form, 16):
                assert piece not in output, f"part {piece!r} of a base64 form of {secret[:12]}… survived"


# ---------------------------------------------------------------- the canaries
OPENAI_KEY = "sk-proj-" + rand(48, string.ascii_letters + string.digits + "_-")
OPENAI_LEGACY = "sk-" + rand(48)
ANTHROPIC_KEY = "sk-ant-api03-" + rand(93, string.ascii_letters + string.digits + "_-") + "AA"
DEEPSEEK_KEY = "sk-" + rand(32, "0123456789abcdef")
GITHUB_PAT = "ghp_" + rand(36)
GITHUB_OAUTH = "gho_" + rand(36)
GITHUB_FINE = "github_pat_" + rand(22) + "_" + rand(59)
AWS_ACCESS_KEY_ID = "AKIA" + rand(16, string.ascii_uppercase + string.digits)
AWS_SECRET = rand(40, string.ascii_letters + string.digits + "/+")
SLACK_BOT = "xoxb-" + rand(12, string.digits) + "-" + rand(13, string.digits) + "-" + rand(24)
SLACK_USER = "xoxp-" + rand(12, string.digits) + "-" + rand(24)
BEARER = rand(40, string.ascii_letters + string.digits + "-._~")
URL_PASSWORD = "Pg-" + rand(18)
GIT_URL_TOKEN = rand(24)
PEM_BODY = [rand(64, string.ascii_letters + string.digits + "+/") for _ in range(6)]
OPENSSH_BODY = [rand(70, string.ascii_letters + string.digits + "+/") for _ in range(4)]
DEPLOY_TOKEN = rand(32)
DB_PASSWORD = "hunter2-" + rand(12)
JSON_API_KEY = rand(32, string.hexdigits.lower())
CLI_PASSWORD = "Cl1-" + rand(16)
CLI_API_KEY = rand(28)
GOOGLE_KEY = "AIza" + rand(35, string.ascii_letters + string.digits + "_-")
GITLAB_PAT = "glpat-" + rand(20, string.ascii_letters + string.digits + "_-")
CHORUS_TOKEN = "cho_" + rand(8, "0123456789abcdef") + "_" + rand(43, string.ascii_letters + string.digits + "_-")
JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9." + rand(60) + "." + rand(43, string.ascii_letters + string.digits + "_-")
BASIC_CREDENTIALS = "deploy:" + rand(20)
YAML_PASSWORD = "Yml-" + rand(20)
QUOTED_PASSWORD = "correct horse battery " + rand(8)
ESCAPED_JSON_PASSWORD = "Tr0ub4dor&3-" + rand(10)
STRIPE_KEY = "sk_live_" + rand(48)
HF_TOKEN = "hf_" + rand(34)
B64_ENV_KEY = "Env-" + rand(30)
B64_EMBEDDED = "sk-ant-api03-" + rand(60, string.ascii_letters + string.digits + "_-")
MYSQL_PWD = "My-" + rand(16)


def pem(kind, body):
    return f"-----BEGIN {kind}PRIVATE KEY-----\n" + "\n".join(body) + f"\n-----END {kind}PRIVATE KEY-----"


def embedded_b64(secret, prefix_len):
    """A longer base64 text in which ``secret`` starts at byte ``prefix_len`` (alignment = prefix_len % 3)."""
    prefix = ("config dump follows: " + "x" * 40)[:prefix_len]
    return b64(f"{prefix}{{\"provider\": \"anthropic\", \"key\": \"{secret}\"}} and some trailing text")


CANARIES = [
    # (id, text, secrets that must disappear)
    ("openai-project", f"openai.AuthenticationError: Incorrect API key provided: {OPENAI_KEY}.", [OPENAI_KEY]),
    ("openai-legacy", f"using key {OPENAI_LEGACY} for completions", [OPENAI_LEGACY]),
    ("anthropic", f"anthropic error 401 for x-api-key {ANTHROPIC_KEY}", [ANTHROPIC_KEY]),
    ("deepseek", f"DSH: key={DEEPSEEK_KEY}", [DEEPSEEK_KEY]),
    ("github-classic", f"remote: Invalid username or token {GITHUB_PAT}", [GITHUB_PAT]),
    ("github-oauth", f"gh auth status: Token: {GITHUB_OAUTH}", [GITHUB_OAUTH]),
    ("github-fine-grained", f"GH_TOKEN {GITHUB_FINE} expired", [GITHUB_FINE]),
    ("aws-key-id", f"aws: credentials for {AWS_ACCESS_KEY_ID} rejected", [AWS_ACCESS_KEY_ID]),
    ("aws-secret-env", f"export AWS_SECRET_ACCESS_KEY={AWS_SECRET}\nexport AWS_REGION=eu-west-1", [AWS_SECRET]),
    ("slack-bot", f"slack_sdk.errors: invalid_auth for {SLACK_BOT}", [SLACK_BOT]),
    ("slack-user", f"posting with {SLACK_USER}", [SLACK_USER]),
    ("bearer-header", f"> GET /v1/models HTTP/1.1\n> Authorization: Bearer {BEARER}\n> Accept: */*", [BEARER]),
    ("bearer-lowercase", f"curl -H 'authorization: bearer {BEARER}' https://api.example.com", [BEARER]),
    ("url-password", f"psycopg.OperationalError: postgres://app:{URL_PASSWORD}@db.internal:5432/app failed",
     [URL_PASSWORD]),
    ("git-url-token", f"fatal: unable to access 'https://x-access-token:{GIT_URL_TOKEN}@github.com/org/repo.git/'",
     [GIT_URL_TOKEN]),
    ("pem-rsa", f"writing key\n{pem('RSA ', PEM_BODY)}\ndone", PEM_BODY),
    ("pem-openssh", pem("OPENSSH ", OPENSSH_BODY), OPENSSH_BODY),
    ("pem-truncated", "-----BEGIN PRIVATE KEY-----\n" + "\n".join(PEM_BODY[:3]), PEM_BODY[:3]),
    ("env-token", f"DEPLOY_TOKEN={DEPLOY_TOKEN}\nHOME=/home/dev", [DEPLOY_TOKEN]),
    ("env-password", f"DATABASE_PASSWORD={DB_PASSWORD}", [DB_PASSWORD]),
    ("env-mysql-pwd", f"MYSQL_PWD={MYSQL_PWD} mysql -u root", [MYSQL_PWD]),
    ("json-api-key", json.dumps({"provider": "openai", "api_key": JSON_API_KEY, "model": "gpt"}), [JSON_API_KEY]),
    ("json-escaped", json.dumps(json.dumps({"user": "svc", "password": ESCAPED_JSON_PASSWORD})),
     [ESCAPED_JSON_PASSWORD]),
    ("cli-password", f"mysqldump --user=root --password={CLI_PASSWORD} app", [CLI_PASSWORD]),
    ("cli-api-key-space", f"tool --api-key {CLI_API_KEY} --verbose", [CLI_API_KEY]),
    ("yaml-password", f"database:\n  user: app\n  password: {YAML_PASSWORD}\n", [YAML_PASSWORD]),
    ("quoted-password", f'PASSWORD="{QUOTED_PASSWORD}"', [QUOTED_PASSWORD]),
    ("google", f"https://maps.googleapis.com/maps/api/geocode/json?key={GOOGLE_KEY}", [GOOGLE_KEY]),
    ("gitlab", f"glab: using {GITLAB_PAT}", [GITLAB_PAT]),
    ("chorus-token", f"CHORUS_TOKEN used: {CHORUS_TOKEN}", [CHORUS_TOKEN]),
    ("jwt", f"session cookie {JWT}", [JWT]),
    ("basic-auth", f"Authorization: Basic {b64(BASIC_CREDENTIALS)}", [BASIC_CREDENTIALS.split(':')[1],
                                                                       b64(BASIC_CREDENTIALS)]),
    ("stripe", f"stripe.error.AuthenticationError: {STRIPE_KEY}", [STRIPE_KEY]),
    ("huggingface", f"huggingface-cli login --token {HF_TOKEN}", [HF_TOKEN]),
    # base64 forms
    ("b64-env-line", f"env (base64): {b64('API_KEY=' + B64_ENV_KEY)}", [B64_ENV_KEY]),
    ("b64-export-github", f"secret blob {b64('export GITHUB_TOKEN=' + GITHUB_PAT + chr(10))} end", [GITHUB_PAT]),
    ("b64-bare-key", f"value={b64(ANTHROPIC_KEY)}", [ANTHROPIC_KEY]),
    ("b64-urlsafe", f"token blob {base64.urlsafe_b64encode(('OPENAI_API_KEY=' + OPENAI_KEY).encode()).decode()}",
     [OPENAI_KEY]),
    ("b64-in-clear-and-encoded", f"key {DEEPSEEK_KEY} and again as {b64('x' + DEEPSEEK_KEY)}", [DEEPSEEK_KEY]),
    ("b64-k8s-secret", f"apiVersion: v1\nkind: Secret\ndata:\n  password: {b64(DB_PASSWORD)}\n", [DB_PASSWORD]),
    ("b64-binary-prefix", f"blob {b64(bytes(range(0, 40)) + ('API_KEY=' + B64_ENV_KEY).encode())}", [B64_ENV_KEY]),
    ("b64-line-wrapped", "payload:\n" + "\n".join(textwrap.wrap(embedded_b64(B64_EMBEDDED, 37), 76)),
     [B64_EMBEDDED]),
    ("b64-double", f"helm release {b64(b64('GITHUB_TOKEN=' + GITHUB_PAT))}", [GITHUB_PAT]),
    ("b64-after-path", f"stored at /tmp/{b64('SECRET_KEY=' + B64_ENV_KEY)}", [B64_ENV_KEY]),
] + [
    (f"b64-embedded-offset-{n}", f"response body (base64): {embedded_b64(B64_EMBEDDED, n)}", [B64_EMBEDDED])
    for n in (0, 1, 2, 3, 4, 5, 17)
]


# Issue 8 items 3 and 4: JSON-escaped text, formats the table above lacked, secrets cut by a wrap.
SLACK_WEBHOOK_PATH = "T0" + rand(7, string.ascii_uppercase + string.digits) + "/B0" + rand(
    7, string.ascii_uppercase + string.digits) + "/" + rand(24)
SENDGRID_KEY = "SG." + rand(22, string.ascii_letters + string.digits + "_-") + "." + rand(
    43, string.ascii_letters + string.digits + "_-")
CONNECTION_KEY = "chk_" + rand(8, "0123456789abcdef") + "_" + rand(43, string.ascii_letters + string.digits + "_-")
TASK_TOKEN = "cht_" + b64('{"attempt":"01a22908-cc4c-78a0-89a1-efce8368d4a1"}').rstrip("=") + ":1xYKAm:" + rand(
    43, string.ascii_letters + string.digits + "_-")
ESCAPED_AFTER_NEWLINE = "ghp_" + rand(36)
ESCAPED_QUOTED = "django-insecure-" + rand(30)
ESCAPED_BEARER = rand(40)
SPLIT_TOKEN = "ghp_" + rand(36)
SPLIT_PASSWORD = "Wr4p-" + rand(40)

NEW_CANARIES = [
    ("slack-webhook", f"POST https://hooks.slack.com/services/{SLACK_WEBHOOK_PATH} -> 200",
     [SLACK_WEBHOOK_PATH.rsplit("/", 1)[1]]),
    ("sendgrid", f"python-http-client: 401 for SENDGRID {SENDGRID_KEY}", [SENDGRID_KEY]),
    ("chorus-connection-key", f"CHORUS_DAEMON_KEY={CONNECTION_KEY}", [CONNECTION_KEY]),
    ("chorus-connection-key-bare", f"daemon started with {CONNECTION_KEY} on host a", [CONNECTION_KEY]),
    ("chorus-task-token", f"env: CHORUS_ATTEMPT_ID=1 {TASK_TOKEN} HOME=/root", [TASK_TOKEN]),
    ("json-escaped-newline-token", json.dumps({"type": "text", "text": f"loaded env\n{ESCAPED_AFTER_NEWLINE}\nok"}),
     [ESCAPED_AFTER_NEWLINE]),
    ("json-escaped-quoted-value", json.dumps({"type": "tool", "input": f'SECRET_KEY = "{ESCAPED_QUOTED}"'}),
     [ESCAPED_QUOTED]),
    ("json-escaped-bearer", json.dumps({"text": f"> GET /\n> Authorization: Bearer {ESCAPED_BEARER}\n> Host: x"}),
     [ESCAPED_BEARER]),
    ("split-over-two-lines", "\n".join(textwrap.wrap(f"export GITHUB_TOKEN={SPLIT_TOKEN}", 40)), [SPLIT_TOKEN]),
    ("split-password-wrapped", "\n".join(textwrap.wrap(f"DB_PASSWORD={SPLIT_PASSWORD}", 30)), [SPLIT_PASSWORD]),
    ("split-in-json-line", json.dumps({"text": "\n".join(textwrap.wrap(f"API_TOKEN={SPLIT_PASSWORD}", 32))}),
     [SPLIT_PASSWORD]),
]


def test_there_are_at_least_twenty_canaries():
    assert len(CANARIES) >= 20
    assert len({c[0] for c in CANARIES}) == len(CANARIES)


@pytest.mark.parametrize("text,secrets", [c[1:] for c in CANARIES + NEW_CANARIES],
                         ids=[c[0] for c in CANARIES + NEW_CANARIES])
def test_canary_is_masked(text, secrets):
    for secret in secrets:  # (a wrapped secret is whole once its line breaks are taken out)
        assert carries(text, secret) or secret in re.sub(r"\n|\\n", "", text), "canary table broken"
    output = redact(text)
    assert MASK in output
    assert_masked(output, *secrets)
    assert redact(output) == output  # idempotent


@pytest.mark.parametrize("text,secrets", [c[1:] for c in CANARIES + NEW_CANARIES],
                         ids=[c[0] for c in CANARIES + NEW_CANARIES])
def test_canary_is_masked_inside_json_data(text, secrets):
    data = {"turn": {"details": text, "lines": [text, {"nested": text}]}, "count": 3}
    output = redact_data(data)
    assert output["count"] == 3
    assert_masked(json.dumps(output), *secrets)


def test_all_canaries_in_one_text():
    text = "\n".join(c[1] for c in CANARIES)
    output = redact(text)
    assert_masked(output, *[s for c in CANARIES for s in c[2]])


def test_secret_split_by_a_second_occurrence_of_its_base64():
    # A secret seen in clear also masks its base64 encodings at every alignment elsewhere.
    encoded = [b64(p + GITHUB_PAT)[4:] for p in ("", "a", "ab")]
    text = f"token {GITHUB_PAT}\n" + "\n".join(f"fragment {e}" for e in encoded)
    assert_masked(redact(text), GITHUB_PAT)


# ---------------------------------------------------------------- surrounding text survives
def test_text_around_a_secret_is_kept():
    output = redact(f"step 3/5 failed: Authorization: Bearer {BEARER} (retrying in 2s)")
    assert output.startswith("step 3/5 failed: Authorization: Bearer ")
    assert output.endswith(" (retrying in 2s)")
    output = redact(f"export DEPLOY_TOKEN={DEPLOY_TOKEN}\nexport REGION=eu-west-1\n")
    assert output == f"export DEPLOY_TOKEN={MASK}\nexport REGION=eu-west-1\n"
    output = redact(f"postgres://app:{URL_PASSWORD}@db.internal:5432/app")
    assert output == f"postgres://app:{MASK}@db.internal:5432/app"


# ---------------------------------------------------------------- no false positives
ORDINARY = [
    "/home/dev/projects/chorus-ops/sessions_app/services.py",
    "/usr/lib/python3.11/site-packages/django/db/models/sql/compiler.py:1562 in execute_sql",
    "C:\\Users\\dev\\AppData\\Local\\Temp\\pytest-of-dev\\pytest-12",
    "On branch feature/token-refresh\nYour branch is up to date with 'origin/feature/token-refresh'.\n\n"
    "Changes not staged for commit:\n  (use \"git add <file>...\" to update what will be committed)\n"
    "\tmodified:   chorus_site/tokens.py\n\tmodified:   tests/chorus_site/test_tokens.py\n",
    " chorus_site/redaction.py          | 42 +++++++++++++++++++++++-------\n"
    " 2 files changed, 35 insertions(+), 7 deletions(-)",
    "3974513 Project skeleton: settings, models of SPEC §3, state tables\n"
    "2d10e93 API read routes of SPEC §8, event routes with SSE, live WebSocket consumer",
    "commit 9fceb02d0ae598e95dc970b74767f19372d61af8\nAuthor: Dev <dev@example.com>\n"
    "Date:   Tue Jun 11 10:12:44 2024 +0200\n\n    Merge branch 'fix/api-key-rotation' into main",
    "diff --git a/config/settings.py b/config/settings.py\nindex 83db48f..f735c2e 100644",
    "01a22908-cc4c-78a0-89a1-efce8368d4a1",
    "turn 3f2504e0-4f89-11d3-9a0c-0305e82c3301 of session 6ba7b810-9dad-11d1-80b4-00c04fd430c8",
    "sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "Digest: sha256:a3ed95caeb02ffe68cdd9fd84406680ae93d633cb16422d00e8a7c22955b46d4",
    "The quick brown fox jumps over the lazy dog.",
    "Using basic authentication for the proxy; bearer tokens are configured elsewhere.",
    "Token validation succeeded after refreshing the session.",
    "keyboard layout: us-intl",
    "tokenizer: loaded vocabulary with 50257 entries",
    "usage: input_tokens=1234 output_tokens=5678 max_tokens=4096 cache_read_input_tokens=2048",
    '{"usage": {"input_tokens": 1234, "output_tokens": 56}, "stop_reason": "end_turn"}',
    "json.dumps(payload, sort_keys=True, indent=2)",
    "id = models.UUIDField(primary_key=True, default=uuid7, editable=False)",
    "PWD=/srv/work/repo\nOLDPWD=/srv/work\nHOME=/home/dev\nSHELL=/bin/bash\nLANG=C.UTF-8\n"
    "PATH=/usr/local/bin:/usr/bin:/bin",
    "KEY_FILE=/etc/chorus/daemon.key\nSSH_KEY_PATH=/home/dev/.ssh/id_ed25519.pub",
    "tests/chorus_site/test_tokens.py::test_expired_token_is_refused PASSED                 [ 50%]",
    "===== 123 passed, 2 skipped, 1 xfailed in 4.21s =====",
    "added 1337 packages, and audited 1338 packages in 12s",
    "https://github.com/org/repo/pull/42/files#diff-4f3a2b1c",
    "https://example.com:8443/api/v1/sessions?limit=50&cursor=1234",
    "git@github.com:org/chorus-ops.git",
    "2024-06-11T10:12:44.123456+00:00 INFO chorus_site.events: broadcast of event 1234 failed",
    "pod/chorus-worker-7d9f8b6c5-x2x9k   1/1   Running   0   3d4h",
    "ProcessTokenRefreshHandlerFactory initialised",
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "Traceback (most recent call last):\n  File \"/srv/work/app/main.py\", line 12, in <module>\n"
    "    raise KeyError('missing')\nKeyError: 'missing'",
    "Secrets are managed by Vault; see docs/operations/secrets.md for the rotation procedure.",
    "password reset email sent to the user",
    "ls -la\ntotal 48\ndrwxr-xr-x  5 dev dev 4096 Jun 11 10:12 .\n-rw-r--r--  1 dev dev  512 Jun 11 10:12 .env.example",
    "chorus_site/redaction.py\nchorus_site/idempotency.py\nsessions_app/services.py\nexecutions/services.py\n",
    "-----BEGIN CERTIFICATE-----\n" + "\n".join(textwrap.wrap(b64(bytes(_rng.randrange(256) for _ in range(600))), 64))
    + "\n-----END CERTIFICATE-----",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGv3bq6VxWbFZ1Yb0Yx2HfM1r9r7L3n4Qm8sQ1p2Xy9Z dev@laptop",
    # from our own docs: placeholders and keys that name no secret
    'curl -H "Idempotency-Key: answer-$TURN" -H "Authorization: Bearer $ADMIN_TOKEN" "$CHORUS/api/v1/runs"',
    "export CHORUS=http://127.0.0.1:8000 TOKEN=cho_...\nADMIN_TOKEN=cho_...   # an ops_admin's token",
    '{"key": "build", "type": "agent", "idea_key": "incident-4711", "depends_on": ["build"]}',
    "The run's failure is `node_failed` with one `key: message` per failed node.",
    '{"type":"text","text":"step 1\\nDone\\nPASSED"}',
    "Response headers:\n  Idempotency-Key: enforce-limit-1\n  Content-Type: application/json",
    'export CHORUS_DAEMON_KEY="$(cat /etc/chorus/daemon.key)"   # or a chmod 600 config file',
    "gitleaks without generic-api-key: 14/62 detected, 0 false positives",
]


@pytest.mark.parametrize("text", ORDINARY, ids=[f"ordinary-{n}" for n in range(len(ORDINARY))])
def test_ordinary_text_is_not_altered(text):
    assert redact(text) == text


def test_ordinary_data_is_not_altered():
    data = {
        "usage": {"input_tokens": 1234, "output_tokens": 56, "cache_read_input_tokens": 0},
        "changes": {"files": ["src/token_store.py", "docs/secrets.md"], "stat": "2 files changed"},
        "ids": ["01a22908-cc4c-78a0-89a1-efce8368d4a1"],
        "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "monkey": "banana",
        "keyboard": "us",
        "flag": True,
        "nothing": None,
        "nodes": [{"key": "docs", "prompt": "write the docs"}, {"key": 4711}],
        "idempotency_key": "answer-3f2504e0-4f89-11d3-9a0c-0305e82c3301",
    }
    assert redact_data(data) == data


@pytest.mark.parametrize("key", ["api_key", "API_KEY", "apiKey", "password", "client_secret", "x-api-key",
                                 "GITHUB_TOKEN", "accessToken", "db_password"])
def test_redact_data_masks_values_under_secret_names(key):
    output = redact_data({key: "plain-looking-value", "pin": 1234, "nested": {key: 987654}})
    assert output[key] == MASK
    assert output["nested"][key] == MASK
    assert output["pin"] == 1234


def test_redact_handles_empty_values():
    assert redact(None) is None
    assert redact("") == ""
    assert redact_data([]) == []
    assert redact_data(None) is None


# ---------------------------------------------------------------- property: any alignment, any wrapping
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_printable = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=120)


@settings(max_examples=150, deadline=None, database=None)  # no .hypothesis/ in the work tree
@given(
    secret_tail=st.text(alphabet=string.ascii_letters + string.digits, min_size=24, max_size=60),
    before=_printable,
    after=_printable,
    wrap=st.sampled_from([None, 64, 76]),
    urlsafe=st.booleans(),
    lead=st.sampled_from(["", " ", "\n", "blob=", "/tmp/", "x-"]),
)
def test_secret_in_base64_is_masked_at_any_alignment(secret_tail, before, after, wrap, urlsafe, lead):
    secret = "sk-ant-api03-" + secret_tail
    raw = f"{before} {secret} {after}".encode()
    encoded = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(raw).decode()
    if wrap:
        encoded = "\n".join(textwrap.wrap(encoded, wrap))
    output = redact(f"log line {lead}{encoded}\nnext line")
    assert_masked(output, secret)
    assert output.endswith("\nnext line") or output.endswith(MASK)


def test_raw_authorization_header_inside_base64_is_masked():
    raw = "Authorization: " + BEARER
    assert_masked(redact(f"captured headers: {b64(raw)}"), BEARER)


# ---------------------------------------------------------------- a stream of events (one turn's output)
from chorus_site.redaction import REPLACEMENT, StreamRedactor, clean_text, ingest  # noqa: E402


def test_private_key_printed_line_by_line_is_masked_through_its_end():
    lines = ["writing key", "-----BEGIN RSA PRIVATE KEY-----", *PEM_BODY, "-----END RSA PRIVATE KEY-----", "done"]
    stream = StreamRedactor()
    out = [stream.event({"kind": "text", "data": {"text": line, "raw": True}}) for line in lines]
    texts = [e["data"]["text"] for e in out]
    assert_masked("\n".join(texts), *PEM_BODY)
    assert texts[0] == "writing key" and texts[-1] == "done"
    assert all(e["kind"] == "text" and e["data"]["raw"] is True for e in out)
    assert redact(PEM_BODY[0]) == PEM_BODY[0]  # alone, a base64 line is no secret (certificates look the same)


def test_secret_cut_across_two_events_is_masked():
    first, rest = f"export GITHUB_TOKEN={SPLIT_TOKEN}"[:40], f"export GITHUB_TOKEN={SPLIT_TOKEN}"[40:]
    stream = StreamRedactor()
    texts = [stream.text(t) for t in (first, rest, "Done", "PASSED")]
    assert_masked("\n".join(texts), SPLIT_TOKEN)
    assert texts[2:] == ["Done", "PASSED"]


def test_ordinary_lines_through_a_stream_are_not_altered():
    stream = StreamRedactor()
    for text in ORDINARY:
        for line in text.split("\n"):
            assert stream.text(line) == line


# ---------------------------------------------------------------- ingestion: storable and redacted
def test_ingest_replaces_nul_and_lone_surrogates():
    assert clean_text("a\x00b\ud800c\udfffd") == f"a{REPLACEMENT}b{REPLACEMENT}c{REPLACEMENT}d"
    value = ingest({"text\x00": "x\x00y", "items": [{"text": f"token {GITHUB_PAT}\x00"}], "n": 3, "ok": True})
    assert value == {f"text{REPLACEMENT}": f"x{REPLACEMENT}y", "items": [{"text": f"token {MASK}{REPLACEMENT}"}],
                     "n": 3, "ok": True}
    json.dumps(value).encode("utf-8")  # every string encodes


def test_ingest_leaves_ordinary_reports_alone():
    report = {"report_id": "0b4c7f1e-3c1a-4e57-9a43-3f1b2c1d0e9f", "status": "ended", "pid": 4242,
              "usage": {"input": 12, "output": 3, "cache_read": 0, "cache_write": 0},
              "changes": {"git": True, "status": ["M chorus_site/tokens.py"], "diff_stat": "1 file changed"},
              "background_processes": [{"pid": 77, "cmdline": "python -m http.server 8000"}],
              "requires_action": {"kind": "confirmation", "items": [{"id": "req-1-1", "text": "Deploy to staging?"}]},
              "final_reply": "Done: 3 files changed, tests pass."}
    assert ingest(report) == report
