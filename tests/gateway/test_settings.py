"""The one settings object: sources, precedence, flags, redaction."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.serve_cmd import add_arguments, overrides_from_args, settings_from_args
from gateway.settings import ConfigError, Settings, load_settings


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults() -> None:
    s = load_settings()
    assert (s.host, s.port, s.upstream.max_retries) == ("127.0.0.1", 8000, 2)
    assert s.policy.name == "cache-aware" and s.index.backend == "memory"
    assert s.admin.token is None and s.admin.port is None and s.hashing.block_chars == 256
    assert (s.server.header_timeout_s, s.server.body_timeout_s, s.server.shutdown_grace_s) == (30.0, 60.0, 300.0)


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text('port = 9000\n[upstream]\nread_timeout_s = 5\n[policy]\nname = "random"\nseed = 3\n'
                   '[registry]\nprobe_interval_s = 7\nreplicas = ["http://file:1"]\n')
    monkeypatch.setenv("KVGATE_POLICY__NAME", "round-robin")
    monkeypatch.setenv("KVGATE_REGISTRY__PROBE_INTERVAL_S", "3")
    monkeypatch.setenv("KVGATE_PORT", "9100")
    s = settings_from_args(_args("--config", str(cfg), "--port", "9200", "--replica", "http://a:1",
                                 "--replica", "http://b:2"))
    assert s.port == 9200  # flag
    assert s.policy.name == "round-robin" and s.policy.seed == 3  # env, file (same section merged)
    assert s.registry.probe_interval_s == 3.0  # env over file
    assert s.registry.replicas == ["http://a:1", "http://b:2"]  # flag over file
    assert s.upstream.read_timeout_s == 5.0  # file over default


def test_yaml_file_and_set_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("policy:\n  name: least-load\nhashing:\n  block_chars: 128\n")
    s = settings_from_args(_args("--config", str(cfg), "--set", "policy.params.alpha=0.5",
                                 "--set", "sessions.use_user_field=false", "--set", "admin.token=abc"))
    assert s.policy.name == "least-load" and s.policy.params == {"alpha": 0.5}
    assert s.hashing.block_chars == 128 and s.sessions.use_user_field is False
    assert s.admin_token_value() == "abc"


def test_flags_map_onto_fields() -> None:
    overrides = overrides_from_args(_args("--policy", "random", "--redis-url", "redis://h:6379/0",
                                          "--admin-token", "t", "--admin-token-file", "/run/t",
                                          "--log-level", "debug", "--host", "0.0.0.0"))
    assert overrides == {"policy": {"name": "random"}, "index": {"redis_url": "redis://h:6379/0"},
                         "registry": {"shared": {"redis_url": "redis://h:6379/0"}},
                         "admin": {"token": "t", "token_file": "/run/t"}, "log_level": "debug", "host": "0.0.0.0"}


def test_unknown_fields_and_bad_values_fail() -> None:
    with pytest.raises(ValueError):
        load_settings(overrides={"no_such_field": 1})
    with pytest.raises(ValueError):
        load_settings(overrides={"upstream": {"max_retries": -1}})
    with pytest.raises(SystemExit):
        overrides_from_args(_args("--set", "novalue"))


def test_redacted_dump_hides_secrets() -> None:
    s = load_settings(overrides={"admin": {"token": "topsecret"}, "index": {"redis_url": "redis://u:pw@h:1/0"}})
    dump = s.redacted_dump()
    assert dump["admin"]["token"] == "***"
    assert dump["index"]["redis_url"] == "redis://u:***@h:1/0"
    assert "topsecret" not in repr(s) and isinstance(s, Settings)


def test_sglang_baseline_keeps_routing_text() -> None:
    assert load_settings(overrides={"policy": {"name": "sglang-cache-aware"}}).hashing.keep_routing_text
    assert not load_settings().hashing.keep_routing_text


def test_sections_from_env_and_moved_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN__TOKEN", "from-env")
    monkeypatch.setenv("KVGATE_ADMIN__PORT", "8001")
    monkeypatch.setenv("KVGATE_SERVER__MAX_CONNECTIONS", "99")
    s = load_settings()
    assert s.admin_token_value() == "from-env" and s.admin.port == 8001 and s.server.max_connections == 99
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "legacy")  # the old variable: below the section's own
    assert load_settings().admin_token_value() == "from-env"
    monkeypatch.delenv("KVGATE_ADMIN__TOKEN")
    assert load_settings().admin_token_value() == "legacy"
    monkeypatch.delenv("KVGATE_ADMIN_TOKEN")
    old = load_settings(overrides={"admin_token": "old"})  # the name before sections
    assert old.admin_token_value() == "old"


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("bad.toml", "port = 8000\n[server]\nmax_connections = -1\n",
     "config file {p}, line 3: field server.max_connections: Input should be greater than or equal to 1"),
    ("bad.toml", "port = \n", "config file {p}, line 1: Invalid value (column 8)"),
    ("bad.yaml", "server:\n  header_timeout_s: 0\n",
     "config file {p}, line 2: field server.header_timeout_s: Input should be greater than 0"),
    ("bad.yaml", "policy: [\n  x: 1\n", "config file {p}, line 3: expected ',' or ']', but got '<stream end>'"),
    ("bad.yaml", "no_such: 1\n", "config file {p}, line 1: field no_such: Extra inputs are not permitted"),
    ("bad.yaml", "- 1\n", "config file {p}: top level must be a table/mapping"),
    ("bad.ini", "", "config file {p}: expected .toml, .yaml or .yml"),
])
def test_config_errors_are_one_line(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value) == expected.format(p=path)


def test_config_error_without_file_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^field server.max_concurrent_requests: Input should be"):
        load_settings(overrides={"server": {"max_concurrent_requests": 0}})


def test_connection_limit_stays_below_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from gateway import serve_cmd as edge

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    monkeypatch.setattr(resource, "setrlimit", lambda *_: None)
    s = load_settings(overrides={"server": {"max_connections": 4096}, "upstream": {"max_connections": 256}})
    assert edge.connection_limit(s) == 1024 - 256 - edge.FD_MARGIN
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 65536))  # raised to what is needed
    assert edge.connection_limit(s) == 4096


def test_replica_urls_are_canonical_and_metadata_needs_the_setting() -> None:
    """Issue 41, item 7: spellings of one replica are one entry; a metadata service is
    refused unless ``registry.allow_link_local_replicas`` (replicas/urls.py)."""
    s = settings_from_args(_args("--replica", "HTTP://0x7f000001:30000/", "--replica", "http://127.0.0.1:30000"))
    assert s.registry.replicas == ["http://127.0.0.1:30000"] and not s.registry.allow_link_local_replicas
    with pytest.raises(ConfigError, match=r"registry\.replicas.*metadata"):
        settings_from_args(_args("--replica", "http://metadata.google.internal"))
    allowed = settings_from_args(_args("--replica", "http://metadata.google.internal",
                                       "--set", "registry.allow_link_local_replicas=true"))
    assert allowed.registry.replicas == ["http://metadata.google.internal"]
