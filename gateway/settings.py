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

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources import InitSettingsSource

from gateway.admission import AdmissionConfig
from gateway.context import HashingConfig, SessionConfig
from gateway.models import ModelsConfig
from gateway.responses_store import ResponsesStoreConfig
from gateway.scaling import ScaleConfig
from gateway.upstream_config import UpstreamConfig
from policies.config import PolicyConfig
from prefix_index.config import IndexConfig
from replicas.config import RegistryConfig

POLICIES_NEEDING_ROUTING_TEXT = frozenset({"sglang-cache-aware"})
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
# old top-level name -> (section, field): still accepted from files, flags and --set
MOVED_FIELDS = {"admin_token": ("admin", "token")}
# fields that no longer exist: a config still setting one is refused with what replaced it
REMOVED_SERVER_FIELDS = {
    "keep_alive_timeout_s": "server.header_timeout_s bounds idle keep-alive connections now",
    "idle_timeout_s": "server.header_timeout_s bounds silent new connections now",
    "callback_path": "there is one request path",
}


def refuse_removed(data: Any, removed: Mapping[str, str], section: str) -> Any:
    """A ``mode="before"`` check: a removed field is an error that says what replaced it."""
    if isinstance(data, Mapping):
        for name in removed.keys() & data.keys():
            raise ValueError(f"{section}.{name} was removed: {removed[name]}")
    return data


class ServerConfig(BaseModel):
    """The client side of the gateway process: deadlines and caps (``gateway/server.py``)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        return refuse_removed(data, REMOVED_SERVER_FIELDS, "server")

    header_timeout_s: float = Field(
        default=30.0, gt=0,
        description="a client connection must deliver a request's headers within this of its start or of its "
        "previous response, else it is closed: a silent new connection, headers trickled byte by byte and an idle "
        "keep-alive connection alike. Keep it above the idle timeout of an L7 proxy in front (or lower that one), "
        "so the proxy closes first and never sends on a connection the gateway is closing")
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="the whole request body must arrive within this of the start of the "
        "request (else 408, the connection is closed and the request sees a disconnect)")
    max_connections: int = Field(
        default=4096, ge=1, description="open client connections; at the cap new connections wait in the listen "
        "backlog until one ends (an idle one at the latest after header_timeout_s), never refused for idle ones")
    max_concurrent_requests: int = Field(
        default=2048, ge=1, description="requests in progress; beyond it 503 (OpenAI-shaped, Retry-After). "
        "GET /health, /ready and /metrics are never refused")
    shutdown_grace_s: float = Field(
        default=300.0, ge=0, description="on SIGTERM: /ready turns 503 at once, connections are still "
        "accepted, requests in flight get this long; streams still open then end with an SSE error event "
        "(keep below the pod's terminationGracePeriodSeconds, 330)")
    access_log: bool = Field(
        default=False, description="one INFO line per finished request on the 'kvgate.access' logger: "
        "endpoint, status, replica, route reason, predicted and reported cached tokens, TTFT (gateway/access_log.py)")


class AdminConfig(BaseModel):
    """The admin API: always authenticated; optionally on a listener of its own."""

    token: SecretStr | None = Field(default=None, description="bearer token for /admin/*")
    token_file: Path | None = Field(
        default=None, description="read the token from this file at start-up (a mounted Secret)")
    generated_token_dir: Path | None = Field(
        default=None, description="with neither token nor token_file: where the generated token is written "
        "(mode 0600, admin-token-<port>); None: $XDG_RUNTIME_DIR/kvgate, else ~/.cache/kvgate")
    host: str | None = Field(default=None, description="address of the admin listener (None: the main host)")
    port: int | None = Field(
        default=None, ge=0, le=65535, description="None: /admin/* on the main listener; a port: a separate "
        "listener serving /admin/* and the probes /health, /ready, /metrics (its own connection slots: "
        "client traffic never starves them), and the main port no /admin/*")


class Settings(BaseSettings):
    """Everything `kvgate serve` can be told. Durations carry their unit in the name."""

    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    log_level: LogLevel = Field(default="info", description="log level of the gateway process")

    server: ServerConfig = Field(default_factory=ServerConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    hashing: HashingConfig = Field(default_factory=HashingConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    responses: ResponsesStoreConfig = Field(default_factory=ResponsesStoreConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        """Accept the names of fields that moved into a section (``admin_token`` ->
        ``admin.token``); the section's own value wins when both are given."""
        if not isinstance(data, dict) or not MOVED_FIELDS.keys() & data.keys():
            return data
        data = dict(data)
        for old, (section, name) in MOVED_FIELDS.items():
            if old in data:
                value = data.pop(old)
                target = data.get(section)
                target = dict(target) if isinstance(target, Mapping) else {}
                target.setdefault(name, value)
                data[section] = target
        return data

    @model_validator(mode="after")
    def _routing_text_when_needed(self) -> Settings:
        """The sglang-cache-aware baseline routes on the request's text: keep it."""
        if self.policy.name in POLICIES_NEEDING_ROUTING_TEXT and not self.hashing.keep_routing_text:
            self.hashing = self.hashing.model_copy(update={"keep_routing_text": True})
        return self

    def admin_token_value(self) -> str | None:
        return None if self.admin.token is None else self.admin.token.get_secret_value()

    def redacted_dump(self) -> dict[str, Any]:
        """The effective configuration as JSON-able data, secrets replaced by ``***``."""
        data: dict[str, Any] = self.model_dump(mode="json")
        if self.admin.token is not None:
            data["admin"]["token"] = "***"
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


class ConfigError(ValueError):
    """A configuration problem in one line: the file, the line when known, the field."""


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML or YAML config file into the nested dict the settings expect."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config file {path}: expected .toml, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data: Any = tomllib.loads(text) if suffix == ".toml" else (yaml.safe_load(text) or {})
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        where = f", line {found[1]}" if found else ""
        message = str(exc).replace(found[0], f"(column {found[2]})") if found else str(exc)
        raise ConfigError(f"config file {path}{where}: {message}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f", line {mark.line + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path}{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table/mapping")
    return data


def _file_line(path: Path, keys: list[str]) -> int | None:
    """The line of ``path`` that sets the field ``keys`` (or its deepest section), if any."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".toml":
        return _toml_line(text, keys)
    node: Any = yaml.compose(text)
    found: int | None = None
    for key in keys:
        pairs = node.value if isinstance(node, yaml.MappingNode) else []
        match = next(((k, v) for k, v in pairs if k.value == key), None)
        if match is None:
            break
        found, node = match[0].start_mark.line + 1, match[1]
    return found


def _toml_line(text: str, keys: list[str]) -> int | None:
    table: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        header = re.match(r"\[\[?([^\]]+)\]", line)
        key = None if header else re.match(r"([\w.\"' -]+?)\s*=", line)
        found = header or key
        names = [k.strip().strip("\"'") for k in found[1].split(".")] if found else []
        if header:
            table = names
        elif key and keys[:len(table) + len(names)] == table + names:
            return number
    return None


def _validation_message(exc: ValidationError, config_file: Path | None, file_data: dict[str, Any]) -> str:
    """The first error of a failed validation as one line, naming the field and the file line."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    keys = [str(p) for p in first["loc"]]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    text = f"field {'.'.join(keys) or '(settings)'}: {first['msg']}{more}"
    node: Any = file_data
    for key in keys:  # the value came from the file if the file has this field
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            node = node.get(key) if isinstance(node, dict) else None
    if config_file is None or node is None:
        return text
    line = _file_line(config_file, keys)
    return f"config file {config_file}{'' if line is None else f', line {line}'}: {text}"


def load_settings(
    config_file: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Build the settings: ``overrides`` (CLI flags) > environment > config file > defaults.

    ``overrides`` is nested like the settings (``{"registry": {"replicas": [...]}}``). Any
    problem raises ``ConfigError`` (a ``ValueError``) with a one-line message.
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
            return (init_settings, env_settings, InitSettingsSource(settings_cls, _legacy_env()),
                    InitSettingsSource(settings_cls, file_data))

    try:
        loaded = _Loaded(**dict(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc, config_file, file_data)) from None
    # a plain Settings (no env re-read): every field already resolved above
    return Settings.model_construct(**{name: getattr(loaded, name) for name in Settings.model_fields})


def _legacy_env() -> dict[str, Any]:
    """``KVGATE_ADMIN_TOKEN`` (the variable before the ``admin`` section; ``kvgate drain``
    reads it too) still sets ``admin.token``, below ``KVGATE_ADMIN__TOKEN``."""
    token = os.environ.get("KVGATE_ADMIN_TOKEN")
    return {"admin": {"token": token}} if token else {}


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
