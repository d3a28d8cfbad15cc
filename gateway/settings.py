"""The gateway's one configuration object, composed of every package's config section.

Sources, highest priority first:

1. command-line flags of ``kvgate serve`` (mapped onto these same fields by
   ``gateway/serve_cmd.py``; see ``FLAG_FIELDS``),
2. environment variables ``KVGATE_<FIELD>``, nested with ``__``
   (``KVGATE_POLICY__NAME=round-robin``, ``KVGATE_REGISTRY__PROBE_INTERVAL_S=1``;
   lists and dicts as JSON: ``KVGATE_REGISTRY__REPLICAS='["http://h:1"]'``),
3. a TOML (``.toml``) or YAML (``.yaml``/``.yml``) config file (``--config``),
4. the defaults below.

Sections merge field by field across sources (a flag setting ``registry.replicas`` keeps
``registry.probe_interval_s`` from the environment). The object is built once at
start-up, passed explicitly, and logged with secrets redacted (``redacted_dump``).
"""
from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml  # type: ignore[import-untyped]
from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources import InitSettingsSource

from gateway.context import HashingConfig, SessionConfig
from gateway.scaling import ScaleConfig
from policies.config import PolicyConfig
from prefix_index.config import IndexConfig
from replicas.config import RegistryConfig

POLICIES_NEEDING_ROUTING_TEXT = frozenset({"sglang-cache-aware"})
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class Settings(BaseSettings):
    """Everything `kvgate serve` can be told. Durations carry their unit in the name."""

    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    admin_token: SecretStr | None = Field(
        default=None, description="bearer token for /admin/* (None: admin API open)"
    )
    log_level: LogLevel = Field(default="info", description="log level of the gateway process")
    connect_timeout_s: float = Field(default=2.0, gt=0, description="TCP connect to a replica")
    first_byte_timeout_s: float = Field(
        default=300.0, gt=0,
        description="from sending a request to the replica's first body byte (covers queueing + prefill); "
        "a request that times out before its first byte is retried elsewhere",
    )
    read_timeout_s: float = Field(
        default=120.0, gt=0,
        description="longest silence on an upstream connection (every read, before and after the first byte)",
    )
    max_retries: int = Field(
        default=2, ge=0, description="extra attempts on other replicas when one fails before the first byte"
    )
    reserve_margin: float = Field(
        default=0.05, ge=0, le=1,
        description="shared state only: replicas scoring within this of the policy's pick are interchangeable; "
        "reserve() takes the least loaded of them across gateways (0: always the pick)",
    )
    max_connections: int = Field(
        default=1024, ge=1, description="upstream connection pool size (all replicas), keep-alive"
    )
    keep_alive_timeout_s: float = Field(
        default=75.0, gt=0,
        description="close a client's idle keep-alive connection after this; longer than clients' "
        "own idle expiry (httpx/openai 5 s, load balancers 60 s) so the client always closes first "
        "and never sends a request on a connection the gateway is closing",
    )

    index: IndexConfig = Field(default_factory=IndexConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    hashing: HashingConfig = Field(default_factory=HashingConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)

    @model_validator(mode="after")
    def _routing_text_when_needed(self) -> Settings:
        """The sglang-cache-aware baseline routes on the request's text: keep it."""
        if self.policy.name in POLICIES_NEEDING_ROUTING_TEXT and not self.hashing.keep_routing_text:
            self.hashing = self.hashing.model_copy(update={"keep_routing_text": True})
        return self

    def admin_token_value(self) -> str | None:
        return None if self.admin_token is None else self.admin_token.get_secret_value()

    def redacted_dump(self) -> dict[str, Any]:
        """The effective configuration as JSON-able data, secrets replaced by ``***``."""
        data: dict[str, Any] = self.model_dump(mode="json")
        if self.admin_token is not None:
            data["admin_token"] = "***"
        redacted = _redact_urls(data)
        assert isinstance(redacted, dict)
        return redacted


_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@]*):(?P<pw>[^@/]+)@", re.IGNORECASE)


def _redact_urls(value: Any) -> Any:
    """Replace the password of any ``scheme://user:password@host`` string by ``***``."""
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\g<scheme>\g<user>:***@", value)
    if isinstance(value, dict):
        return {k: _redact_urls(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_urls(v) for v in value]
    return value


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML or YAML config file into the nested dict the settings expect."""
    suffix = path.suffix.lower()
    text = path.read_text(encoding="utf-8")
    if suffix == ".toml":
        data: Any = tomllib.loads(text)
    elif suffix in (".yaml", ".yml"):
        data = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"config file {path}: expected .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: top level must be a table/mapping")  # noqa: TRY004
    return data


def load_settings(
    config_file: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Build the settings: ``overrides`` (CLI flags) > environment > config file > defaults.

    ``overrides`` is nested like the settings (``{"registry": {"replicas": [...]}}``).
    """
    file_data = read_config_file(config_file) if config_file is not None else {}

    class _Loaded(Settings):
        model_config = SettingsConfigDict(title="Settings")  # error messages name "Settings"

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, file_data))

    loaded = _Loaded(**dict(overrides or {}))
    # a plain Settings (no env re-read): every field already resolved above
    return Settings.model_construct(**{name: getattr(loaded, name) for name in Settings.model_fields})


def set_path(target: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_path(d, "policy.name", "x")`` -> ``d["policy"]["name"] = "x"`` (creating tables)."""
    *parents, leaf = dotted.split(".")
    node = target
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"{dotted}: {key} is not a section")  # noqa: TRY004
        node = child
    node[leaf] = value



def config_reference(flags: Mapping[str, tuple[str, ...]] | None = None) -> str:
    """The configuration reference table of gateway/README.md, generated from the models.

    ``python -c "from gateway.serve_cmd import FLAG_FIELDS as F; from gateway.settings import
    config_reference as c; print(c(F))"``
    """
    by_field = {f: "--" + dest.replace("_", "-") for dest, fs in (flags or {}).items() for f in fs}
    lines = ["| field | default | environment | flag | meaning |", "|---|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            path = prefix + name
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                walk(info.annotation, path + ".")
                continue
            default = repr(info.get_default(call_default_factory=True))
            default = default if len(default) <= 40 else "(see code)"
            env = "KVGATE_" + path.upper().replace(".", "__")
            meaning = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{path}` | `{default}` | `{env}` | {by_field.get(path, '')} | {meaning} |")

    walk(Settings, "")
    return "\n".join(lines)
