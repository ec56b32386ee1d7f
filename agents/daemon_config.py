"""Settings of the daemon (SPEC §5): command-line flags > environment > config file > defaults.

``build_config(options, environ, file_values)`` is a pure function: it reads nothing but its
arguments and answers a ``DaemonConfig`` or raises ``ConfigError`` naming the setting, where it came
from and what is expected. ``load_config_file`` reads TOML (``tomllib``) or JSON; ``add_arguments``
declares the flags on any argparse parser (the Django command and ``python -m agents.daemon`` share
it). Flags default to None so that "not given" can fall through to the environment.

Like the rest of the daemon side of ``agents/``, this module imports nothing of the portal.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

DEFAULT_BACKEND = "scripted"
DEFAULT_MAX_CONCURRENCY = 4
DEFAULT_SIGINT_TIMEOUT_S = 10.0
MAX_CONCURRENCY_LIMIT = 256
SIGINT_TIMEOUT_LIMIT_S = 3600.0
BACKEND_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

# setting -> (flag, environment variable, config file key)
SETTINGS = {
    "portal": ("--portal", "CHORUS_PORTAL_URL", "portal"),
    "key": ("--key", "CHORUS_DAEMON_KEY", "key"),
    "cwds": ("--cwd", "CHORUS_DAEMON_CWDS", "cwds"),
    "backend": ("--backend", "CHORUS_DAEMON_BACKEND", "backend"),
    "max_concurrency": ("--max-concurrency", "CHORUS_MAX_CONCURRENCY", "max_concurrency"),
    "sigint_timeout_s": ("--sigint-timeout", "CHORUS_SIGINT_TIMEOUT_S", "sigint_timeout_s"),
    "spool_dir": ("--spool-dir", "CHORUS_SPOOL_DIR", "spool_dir"),
}
CONFIG_FILE_ENV = "CHORUS_DAEMON_CONFIG"
# Also accepted in a config file, as aliases a person is likely to write.
FILE_ALIASES = {"portal_url": "portal", "daemon_key": "key"}


class ConfigError(ValueError):
    """A setting is missing or malformed; the message says which, where from, and what is expected."""


@dataclass(frozen=True)
class DaemonConfig:
    portal_url: str            # http(s)://host[:port][/prefix], no trailing slash
    key: str = field(repr=False)
    cwds: tuple[str, ...]      # absolute, resolved directories the daemon may run agents in
    backend: str = DEFAULT_BACKEND
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    sigint_timeout_s: float = DEFAULT_SIGINT_TIMEOUT_S
    spool_dir: str = ""
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)  # setting -> flag|env|file|default

    @property
    def ws_url(self) -> str:
        """The daemon WebSocket: ws(s)://host/prefix/ws/daemon/."""
        from agents.protocol import DAEMON_WS_PATH

        parts = urlsplit(self.portal_url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + DAEMON_WS_PATH, "", ""))

    def api_url(self, path: str) -> str:
        """An absolute URL of a path under /api/v1 (``path`` starts with '/')."""
        from agents.protocol import API_PREFIX

        return self.portal_url + API_PREFIX + path

    def describe(self) -> dict[str, Any]:
        """The settings as they may be logged (the key is never shown)."""
        return {"portal": self.portal_url, "key": "***", "cwds": list(self.cwds), "backend": self.backend,
                "max_concurrency": self.max_concurrency, "sigint_timeout_s": self.sigint_timeout_s,
                "spool_dir": self.spool_dir, "sources": dict(self.sources)}


# ------------------------------------------------------------------------------------ argparse

def add_arguments(parser) -> None:
    parser.add_argument("--portal", dest="portal", default=None, metavar="URL",
                        help="portal base URL, e.g. https://chorus.example.com (env CHORUS_PORTAL_URL)")
    parser.add_argument("--key", dest="key", default=None, metavar="KEY",
                        help="the connection key shown once by the portal (env CHORUS_DAEMON_KEY)")
    parser.add_argument("--cwd", dest="cwds", action="append", default=None, metavar="DIR",
                        help="a directory agents may run in; repeat for several "
                             "(env CHORUS_DAEMON_CWDS, os.pathsep-separated; default: the current directory)")
    parser.add_argument("--backend", dest="backend", default=None, metavar="NAME",
                        help=f"agent backend (env CHORUS_DAEMON_BACKEND; default {DEFAULT_BACKEND})")
    parser.add_argument("--max-concurrency", dest="max_concurrency", default=None, metavar="N",
                        help=f"agents running at once (env CHORUS_MAX_CONCURRENCY; default {DEFAULT_MAX_CONCURRENCY})")
    parser.add_argument("--sigint-timeout", dest="sigint_timeout_s", default=None, metavar="S",
                        help="seconds between the stop request and killing the process tree "
                             f"(env CHORUS_SIGINT_TIMEOUT_S; default {DEFAULT_SIGINT_TIMEOUT_S:g})")
    parser.add_argument("--spool-dir", dest="spool_dir", default=None, metavar="DIR",
                        help="where reports wait until the portal has them (env CHORUS_SPOOL_DIR; "
                             "default ~/.chorus/daemon/<portal+key hash>/)")
    parser.add_argument("--config", dest="config", default=None, metavar="FILE",
                        help="a TOML or JSON file with the same settings (env CHORUS_DAEMON_CONFIG)")


def options_from_namespace(namespace: Any) -> dict[str, Any]:
    """The flags given on the command line (None for those not given)."""
    values = vars(namespace) if not isinstance(namespace, Mapping) else namespace
    return {name: values.get(name) for name in SETTINGS}


# ------------------------------------------------------------------------------------ config file

def load_config_file(path: str) -> dict[str, Any]:
    """Settings from a TOML or JSON file (by extension; otherwise TOML, then JSON).

    The settings may sit at the top level or in a ``[daemon]`` table.
    """
    file_path = Path(path).expanduser()
    try:
        raw = file_path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot be read ({exc.strerror or exc})") from None
    suffix = file_path.suffix.lower()
    text = raw.decode("utf-8", "replace")
    data: Any = None
    errors = []
    parsers = ([("JSON", json.loads)] if suffix == ".json" else
               [("TOML", tomllib.loads)] if suffix == ".toml" else
               [("TOML", tomllib.loads), ("JSON", json.loads)])
    for kind, parse in parsers:
        try:
            data = parse(text)
            break
        except ValueError as exc:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
            errors.append(f"{kind}: {exc}")
    else:
        raise ConfigError(f"config file {path}: not valid " + "; ".join(errors))
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table/object of settings")
    if isinstance(data.get("daemon"), dict):
        data = data["daemon"]
    values = {}
    for name, value in data.items():
        name = FILE_ALIASES.get(name, name)
        if name not in SETTINGS:
            known = ", ".join(sorted(SETTINGS))
            raise ConfigError(f"config file {path}: unknown setting {name!r} (known: {known})")
        values[name] = value
    return values


# ------------------------------------------------------------------------------------ build

def build_config(options: Mapping[str, Any] | None, environ: Mapping[str, str] | None,
                 file_values: Mapping[str, Any] | None, *, cwd: str | None = None,
                 home: str | None = None, check_dirs: bool = True) -> DaemonConfig:
    """Merge the three sources (flag > env > file > default) and validate every setting.

    ``cwd`` resolves relative paths and is the default working-directory root; ``home`` is used
    for ``~`` and the default spool dir. ``check_dirs`` makes a missing cwd an error (tests of
    pure precedence may turn it off).
    """
    options, environ, file_values = dict(options or {}), dict(environ or {}), dict(file_values or {})
    base = cwd or os.getcwd()
    home = home or environ.get("HOME") or os.path.expanduser("~")
    sources: dict[str, str] = {}

    def pick(name: str) -> tuple[Any, str]:
        flag, env_name, file_key = SETTINGS[name]
        if options.get(name) not in (None, [], ""):
            sources[name] = "flag"
            return options[name], flag
        if environ.get(env_name, "").strip():
            sources[name] = "env"
            return environ[env_name], env_name
        if file_values.get(file_key) not in (None, "", []):
            sources[name] = "file"
            return file_values[file_key], f"config file ({file_key})"
        sources[name] = "default"
        return None, "default"

    # portal
    value, where = pick("portal")
    if value is None:
        raise ConfigError("the portal URL is required: --portal URL, CHORUS_PORTAL_URL or 'portal' in the config file")
    portal_url = _portal_url(value, where)

    # key
    value, where = pick("key")
    if value is None:
        raise ConfigError("the connection key is required: --key KEY, CHORUS_DAEMON_KEY or 'key' in the config file")
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise ConfigError(f"{where}: the key must be one word without spaces")
    key = value.strip()

    # cwds
    value, where = pick("cwds")
    if value is None:
        value, where = [base], "default"
    cwds = _cwds(value, where, base=base, home=home, check=check_dirs)

    # backend
    value, where = pick("backend")
    backend = DEFAULT_BACKEND if value is None else value
    if not isinstance(backend, str) or not BACKEND_NAME_RE.match(backend.strip()):
        raise ConfigError(f"{where}: a backend name is lower-case letters, digits and '_', got {backend!r}")
    backend = backend.strip()

    # max_concurrency
    value, where = pick("max_concurrency")
    max_concurrency = DEFAULT_MAX_CONCURRENCY if value is None else _int(value, where, 1, MAX_CONCURRENCY_LIMIT)

    # sigint_timeout_s
    value, where = pick("sigint_timeout_s")
    sigint_timeout_s = (DEFAULT_SIGINT_TIMEOUT_S if value is None
                        else _seconds(value, where, 0.0, SIGINT_TIMEOUT_LIMIT_S))

    # spool_dir
    value, where = pick("spool_dir")
    if value is None:
        digest = hashlib.sha256(f"{portal_url}\n{key}".encode()).hexdigest()[:16]
        spool_dir = os.path.join(home, ".chorus", "daemon", digest, "spool")
    else:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}: the spool dir is a path, got {value!r}")
        spool_dir = _path(value.strip(), base, home)

    return DaemonConfig(portal_url=portal_url, key=key, cwds=cwds, backend=backend,
                        max_concurrency=max_concurrency, sigint_timeout_s=sigint_timeout_s,
                        spool_dir=spool_dir, sources=sources)


def config_from_sources(options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                        config_path: str | None = None) -> DaemonConfig:
    """Read the config file named by ``--config`` or CHORUS_DAEMON_CONFIG, then ``build_config``."""
    environ = dict(os.environ if environ is None else environ)
    path = config_path or environ.get(CONFIG_FILE_ENV) or None
    file_values = load_config_file(path) if path else {}
    return build_config(options, environ, file_values)


# ------------------------------------------------------------------------------------ helpers

def _portal_url(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: the portal URL must be a string, got {value!r}")
    text = value.strip()
    parts = urlsplit(text)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme.lower(), parts.scheme.lower())
    if scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: expected http(s)://host[:port], got {value!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"{where}: the portal URL takes no query or fragment, got {value!r}")
    try:
        parts.port  # noqa: B018 — raises ValueError for a bad port
    except ValueError:
        raise ConfigError(f"{where}: bad port in {value!r}") from None
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _path(text: str, base: str, home: str) -> str:
    if text == "~" or text.startswith("~/"):
        text = home + text[1:]
    return os.path.realpath(os.path.join(base, text))


def _cwds(value: Any, where: str, *, base: str, home: str, check: bool) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [item for item in value.split(os.pathsep)]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"{where}: cwds is a list of directories, got {value!r}")
    result: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{where}: a cwd is a path, got {item!r}")
        if not item.strip():
            continue
        path = _path(item.strip(), base, home)
        if check and not os.path.isdir(path):
            raise ConfigError(f"{where}: {item!r} is not an existing directory")
        if path not in result:
            result.append(path)
    if not result:
        raise ConfigError(f"{where}: at least one working directory is needed")
    return tuple(result)


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a whole number from {low} to {high}, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not re.fullmatch(r"[+]?\d+", text):
            raise ConfigError(f"{where}: expected a whole number from {low} to {high}, got {value!r}")
        value = int(text)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{where}: expected a whole number from {low} to {high}, got {value!r}")
    return value


def _seconds(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected seconds (a number), got {value!r}")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected seconds (a number), got {value!r}") from None
    if not math.isfinite(number) or not low < number <= high:
        raise ConfigError(f"{where}: expected seconds above {low:g} and at most {high:g}, got {value!r}")
    return number
