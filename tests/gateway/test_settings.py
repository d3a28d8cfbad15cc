"""The one settings object: sources, precedence, flags, redaction."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.serve_cmd import add_arguments, overrides_from_args, settings_from_args
from gateway.settings import Settings, load_settings


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults() -> None:
    s = load_settings()
    assert (s.host, s.port, s.max_retries) == ("127.0.0.1", 8000, 2)
    assert s.policy.name == "cache-aware" and s.index.backend == "memory"
    assert s.admin_token is None and s.hashing.block_chars == 256


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text('port = 9000\nread_timeout_s = 5\n[policy]\nname = "random"\nseed = 3\n'
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
    assert s.read_timeout_s == 5.0  # file over default


def test_yaml_file_and_set_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("policy:\n  name: least-load\nhashing:\n  block_chars: 128\n")
    s = settings_from_args(_args("--config", str(cfg), "--set", "policy.params.alpha=0.5",
                                 "--set", "sessions.use_user_field=false", "--set", "admin_token=abc"))
    assert s.policy.name == "least-load" and s.policy.params == {"alpha": 0.5}
    assert s.hashing.block_chars == 128 and s.sessions.use_user_field is False
    assert s.admin_token_value() == "abc"


def test_flags_map_onto_fields() -> None:
    overrides = overrides_from_args(_args("--policy", "random", "--redis-url", "redis://h:6379/0",
                                          "--admin-token", "t", "--log-level", "debug", "--host", "0.0.0.0"))
    assert overrides == {"policy": {"name": "random"}, "index": {"redis_url": "redis://h:6379/0"},
                         "registry": {"shared": {"redis_url": "redis://h:6379/0"}},
                         "admin_token": "t", "log_level": "debug", "host": "0.0.0.0"}


def test_unknown_fields_and_bad_values_fail() -> None:
    with pytest.raises(ValueError):
        load_settings(overrides={"no_such_field": 1})
    with pytest.raises(ValueError):
        load_settings(overrides={"max_retries": -1})
    with pytest.raises(SystemExit):
        overrides_from_args(_args("--set", "novalue"))


def test_redacted_dump_hides_secrets() -> None:
    s = load_settings(overrides={"admin_token": "topsecret", "index": {"redis_url": "redis://u:pw@h:1/0"}})
    dump = s.redacted_dump()
    assert dump["admin_token"] == "***"
    assert dump["index"]["redis_url"] == "redis://u:***@h:1/0"
    assert "topsecret" not in repr(s) and isinstance(s, Settings)


def test_sglang_baseline_keeps_routing_text() -> None:
    assert load_settings(overrides={"policy": {"name": "sglang-cache-aware"}}).hashing.keep_routing_text
    assert not load_settings().hashing.keep_routing_text
