"""Daemon settings: flag > env > file > default, and clear errors for bad values."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from agents.daemon_config import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_SIGINT_TIMEOUT_S,
    ConfigError,
    add_arguments,
    build_config,
    config_from_sources,
    load_config_file,
    options_from_namespace,
)

BASE = {"portal": "http://portal.test:8000", "key": "chk_abc_secret"}


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from_namespace(parser.parse_args(argv))


@pytest.fixture
def dirs(tmp_path):
    names = ["a", "b", "c", "d"]
    for name in names:
        (tmp_path / name).mkdir()
    return {name: str((tmp_path / name).resolve()) for name in names}


def test_defaults(dirs):
    config = build_config(BASE, {}, {}, cwd=dirs["a"], home="/home/x")
    assert config.portal_url == "http://portal.test:8000"
    assert config.cwds == (dirs["a"],)
    assert config.backend == "scripted"
    assert config.max_concurrency == DEFAULT_MAX_CONCURRENCY
    assert config.sigint_timeout_s == DEFAULT_SIGINT_TIMEOUT_S
    assert config.spool_dir.startswith("/home/x/.chorus/daemon/")
    assert config.sources["backend"] == "default" and config.sources["portal"] == "flag"
    assert config.ws_url == "ws://portal.test:8000/ws/daemon/"
    assert config.api_url("/daemon/snapshot") == "http://portal.test:8000/api/v1/daemon/snapshot"
    assert "secret" not in repr(config) and "secret" not in json.dumps(config.describe())


def test_precedence_flag_env_file_default(dirs):
    file_values = {"portal": "https://file.test", "key": "file-key", "cwds": [dirs["a"]], "backend": "codex",
                   "max_concurrency": 2, "sigint_timeout_s": 3, "spool_dir": "/tmp/file-spool"}
    environ = {"CHORUS_PORTAL_URL": "https://env.test", "CHORUS_DAEMON_CWDS": os.pathsep.join([dirs["b"], dirs["c"]]),
               "CHORUS_MAX_CONCURRENCY": "6"}
    options = parse(["--portal", "https://flag.test/", "--cwd", dirs["d"], "--sigint-timeout", "1.5"])

    config = build_config(options, environ, file_values)
    assert config.portal_url == "https://flag.test"            # flag over env and file
    assert config.cwds == (dirs["d"],)                         # flag over env
    assert config.sigint_timeout_s == 1.5                       # flag over file
    assert config.max_concurrency == 6                          # env over file
    assert config.key == "file-key" and config.backend == "codex"   # file over default
    assert config.spool_dir == "/tmp/file-spool"
    assert config.ws_url == "wss://flag.test/ws/daemon/"
    assert config.sources == {"portal": "flag", "key": "file", "cwds": "flag", "backend": "file",
                              "max_concurrency": "env", "sigint_timeout_s": "flag", "spool_dir": "file"}

    config = build_config({}, environ, file_values)
    assert config.portal_url == "https://env.test" and config.cwds == (dirs["b"], dirs["c"])


def test_repeated_cwd_flags_and_blank_env_fall_through(dirs):
    options = parse(["--portal", "http://p", "--key", "k", "--cwd", dirs["a"], "--cwd", dirs["b"], "--cwd", dirs["a"]])
    config = build_config(options, {"CHORUS_DAEMON_BACKEND": "  "}, {"backend": "kiro"})
    assert config.cwds == (dirs["a"], dirs["b"])
    assert config.backend == "kiro"


def test_portal_prefix_and_ws_scheme():
    config = build_config({"portal": "wss://h.test/chorus/", "key": "k"}, {}, {}, check_dirs=False)
    assert config.portal_url == "https://h.test/chorus"
    assert config.ws_url == "wss://h.test/chorus/ws/daemon/"
    assert config.api_url("/x") == "https://h.test/chorus/api/v1/x"


@pytest.mark.parametrize("options, environ, message", [
    ({"key": "k"}, {}, "portal URL is required"),
    ({"portal": "http://p"}, {}, "connection key is required"),
    ({"portal": "ftp://p", "key": "k"}, {}, "expected http(s)://host"),
    ({"portal": "http://p:99999", "key": "k"}, {}, "bad port"),
    ({"portal": "http://p?x=1", "key": "k"}, {}, "no query"),
    ({"portal": "http://p", "key": "two words"}, {}, "one word"),
    (BASE, {"CHORUS_MAX_CONCURRENCY": "many"}, "CHORUS_MAX_CONCURRENCY: expected a whole number from 1 to 256"),
    (BASE, {"CHORUS_MAX_CONCURRENCY": "0"}, "from 1 to 256"),
    ({**BASE, "max_concurrency": "1.5"}, {}, "--max-concurrency: expected a whole number"),
    (BASE, {"CHORUS_SIGINT_TIMEOUT_S": "-1"}, "CHORUS_SIGINT_TIMEOUT_S: expected seconds above 0"),
    (BASE, {"CHORUS_SIGINT_TIMEOUT_S": "nan"}, "expected seconds"),
    (BASE, {"CHORUS_SIGINT_TIMEOUT_S": "soon"}, "expected seconds (a number)"),
    (BASE, {"CHORUS_DAEMON_BACKEND": "Claude Code"}, "CHORUS_DAEMON_BACKEND: a backend name"),
    (BASE, {"CHORUS_DAEMON_CWDS": "/definitely/not/here"}, "'/definitely/not/here' is not an existing directory"),
])
def test_bad_values_name_their_source(options, environ, message, tmp_path):
    with pytest.raises(ConfigError) as info:
        build_config(options, environ, {}, cwd=str(tmp_path))
    assert message in str(info.value)


def test_file_values_are_checked_too(tmp_path):
    with pytest.raises(ConfigError, match=r"config file \(max_concurrency\): expected a whole number"):
        build_config(BASE, {}, {"max_concurrency": True}, cwd=str(tmp_path))
    with pytest.raises(ConfigError, match=r"config file \(cwds\): cwds is a list"):
        build_config(BASE, {}, {"cwds": 5}, cwd=str(tmp_path))


def test_relative_and_home_paths(tmp_path):
    (tmp_path / "work").mkdir()
    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    config = build_config({**BASE, "cwds": ["work", "~/proj"], "spool_dir": "~/spool"}, {}, {}, cwd=str(tmp_path),
                          home=str(home))
    assert config.cwds == (str((tmp_path / "work").resolve()), str((home / "proj").resolve()))
    assert config.spool_dir == str((home / "spool").resolve())


def test_load_toml_json_and_daemon_table(tmp_path):
    toml = tmp_path / "daemon.toml"
    toml.write_text('[daemon]\nportal_url = "http://t"\nkey = "k"\nmax_concurrency = 3\ncwds = ["/tmp"]\n')
    assert load_config_file(str(toml)) == {"portal": "http://t", "key": "k", "max_concurrency": 3, "cwds": ["/tmp"]}
    js = tmp_path / "daemon.json"
    js.write_text(json.dumps({"portal": "http://j", "sigint_timeout_s": 2.5}))
    assert load_config_file(str(js)) == {"portal": "http://j", "sigint_timeout_s": 2.5}
    other = tmp_path / "daemon.conf"
    other.write_text(json.dumps({"backend": "dsh"}))
    assert load_config_file(str(other)) == {"backend": "dsh"}


@pytest.mark.parametrize("name, text, message", [
    ("bad.toml", "portal = ", "not valid TOML"),
    ("bad.json", "{", "not valid JSON"),
    ("list.json", "[1]", "expected a table"),
    ("unknown.toml", 'portl = "x"', "unknown setting 'portl'"),
])
def test_bad_config_files(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config_file(str(path))
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config_file(str(tmp_path / "missing.toml"))


def test_config_from_sources_reads_the_file_named_in_env(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'portal = "http://file"\nkey = "k"\ncwds = ["{tmp_path}"]\n')
    config = config_from_sources({}, {"CHORUS_DAEMON_CONFIG": str(path), "CHORUS_PORTAL_URL": "http://env"})
    assert config.portal_url == "http://env" and config.key == "k"
    config = config_from_sources(parse(["--portal", "http://flag"]), {}, config_path=str(path))
    assert config.portal_url == "http://flag"
