"""Hardware/model profiles for the simulated SGLang replica.

A profile is a frozen value holding every estimate the timing and memory model uses,
each a named parameter, loaded from a TOML file (``profiles/<name>.toml``). The default
profile, ``kimi-k2.6-b200-tp8``, and how its numbers were derived are documented in
``profiles/kimi-k2.6-b200-tp8.md``; ``tiny`` has small pools and fast numbers for tests.

``load_profile`` accepts a profile name (a file in ``profiles/``) or a path to a ``.toml``.
Unknown keys are rejected so that a typo never silently falls back to a default.

One source of truth for a replica's hardware: a profile that models a real launch names
it, ``launch_profile = "<name>"`` (a profile of ``replicas/sglang_profiles``, from which
the gpu-fleet overlay's SGLang command is generated), and takes from it what the launch
decides (``LAUNCH_FIELDS``: model names, TP size, page size, batching limits, context
length, the speculative algorithm and its draft tokens, the HiCache host pool as
``hicache_ratio`` x ``device_tokens``). Such a profile must not set those keys itself;
it keeps only what the launch cannot say (pool sizes from memory math, throughputs).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicas import sglang_args

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "kimi-k2.6-b200-tp8"


class ProfileError(ValueError):
    """A profile file is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Profile:
    """Every estimate of the replica model, by name (units in the field names)."""

    name: str
    served_model_name: str
    tp_size: int
    page_size: int
    device_tokens: int  # KV pool on the GPUs (tokens)
    host_tokens: int  # HiCache host pool (tokens); 0 disables the host tier
    prefill_tokens_per_s: float  # uncached prompt tokens computed per second
    host_load_tokens_per_s: float  # host -> device load-back speed
    decode_step_base_s: float  # one decode step with an empty context
    decode_step_per_ctx_s: float  # + this per running request per 100k context tokens
    spec_algorithm: str | None  # e.g. "DFLASH"; None disables speculative decoding
    spec_accept_length: float  # mean tokens per request per decode step (1.0 without spec): agent-shaped requests
    spec_num_draft_tokens: int
    max_running_requests: int
    chunked_prefill_size: int
    context_length: int
    default_output_tokens: int  # mean natural output length when not ignore_eos
    time_scale: float = 1.0  # simulated seconds per wall second (real-time driver)
    model_path: str = ""  # reported by /model_info, /server_info
    weight_gb_per_gpu: float = 0.0  # reported memory figures (informational)
    kv_bytes_per_token: int = 0
    recent_window_s: float = 10.0  # window of the "recent" gauges (throughput, hit rate)
    version: str = "0.5.23"  # SGLang version imitated
    # plain prose (a chat request without tools, a `prose` workload): its own accept length;
    # 0: the same as ``spec_accept_length`` (`accept_length`)
    spec_accept_length_prose: float = 0.0

    def __post_init__(self) -> None:
        checks = {
            "page_size >= 1": self.page_size >= 1,
            "device_tokens >= page_size": self.device_tokens >= self.page_size,
            "host_tokens >= 0": self.host_tokens >= 0,
            "prefill_tokens_per_s > 0": self.prefill_tokens_per_s > 0,
            "host_load_tokens_per_s > 0": self.host_load_tokens_per_s > 0,
            "decode_step_base_s > 0": self.decode_step_base_s > 0,
            "decode_step_per_ctx_s >= 0": self.decode_step_per_ctx_s >= 0,
            "spec_accept_length >= 1": self.spec_accept_length >= 1.0,
            "spec_accept_length_prose == 0 or >= 1": self.spec_accept_length_prose == 0
            or self.spec_accept_length_prose >= 1.0,
            "max_running_requests >= 1": self.max_running_requests >= 1,
            "chunked_prefill_size >= 1": self.chunked_prefill_size >= 1,
            "context_length >= 2": self.context_length >= 2,
            "default_output_tokens >= 1": self.default_output_tokens >= 1,
            "time_scale > 0": self.time_scale > 0,
            "recent_window_s > 0": self.recent_window_s > 0,
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ProfileError(f"profile {self.name!r}: failed checks: {', '.join(failed)}")

    @property
    def effective_accept_length(self) -> float:
        """Tokens per request per decode step (1.0 when speculative decoding is off)."""
        return self.spec_accept_length if self.spec_algorithm else 1.0

    def accept_length(self, prose: bool) -> float:
        """Tokens per decode step of one request: ``spec_accept_length`` for agent-shaped
        requests, ``spec_accept_length_prose`` (when set) for prose; 1.0 without spec."""
        if prose and self.spec_algorithm and self.spec_accept_length_prose:
            return self.spec_accept_length_prose
        return self.effective_accept_length

    def replace(self, **changes: Any) -> Profile:
        """A copy with some parameters changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _resolve(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or candidate.is_file():
        if not candidate.is_file():
            raise ProfileError(f"profile file not found: {candidate}")
        return candidate
    bundled = PROFILES_DIR / f"{name_or_path}.toml"
    if not bundled.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))
        raise ProfileError(f"unknown profile {name_or_path!r} (known: {known})")
    return bundled


LAUNCH_FIELDS = ("served_model_name", "model_path", "tp_size", "page_size", "max_running_requests",
                 "chunked_prefill_size", "context_length", "spec_algorithm", "spec_num_draft_tokens",
                 "host_tokens")


def _from_launch(data: dict[str, Any], default_name: str) -> dict[str, Any]:
    """The launch profile's facts merged into a simulator profile table (see the module doc)."""
    name = data.pop("launch_profile")
    repeated = sorted(set(data) & set(LAUNCH_FIELDS))
    if repeated:
        raise ProfileError(f"profile {default_name!r}: {repeated} come from launch profile {name!r}; "
                           "set them there")
    try:
        launch = sglang_args.load_profile(str(name))
    except sglang_args.LaunchProfileError as exc:
        raise ProfileError(f"profile {default_name!r}: {exc}") from exc
    device = int(data.get("device_tokens", 0))
    spec = launch.speculative_algorithm
    draft = launch.speculative_dflash_block_size or launch.speculative_num_draft_tokens or 0
    derived = {
        "served_model_name": launch.served_model_name, "model_path": launch.model_path,
        "tp_size": launch.tp_size, "page_size": launch.page_size,
        "max_running_requests": launch.max_running_requests or 0,
        "chunked_prefill_size": launch.chunked_prefill_size or 8192,
        "context_length": launch.context_length or 0,
        "spec_algorithm": spec, "spec_num_draft_tokens": draft,
        "host_tokens": int((launch.hicache_ratio or 2.0) * device) if launch.hicache else 0,
    }
    return {**data, **derived}


def profile_from_dict(data: dict[str, Any], default_name: str) -> Profile:
    """Build a Profile from a parsed TOML table (flat; ``spec_algorithm = ""`` means None)."""
    if "launch_profile" in data:
        data = _from_launch(dict(data), default_name)
    fields = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ProfileError(f"profile {default_name!r}: unknown keys {unknown}")
    values = dict(data)
    values.setdefault("name", default_name)
    if values.get("spec_algorithm") in ("", "none", "None"):
        values["spec_algorithm"] = None
    missing = sorted(
        f.name
        for f in dataclasses.fields(Profile)
        if f.name not in values and f.default is dataclasses.MISSING
    )
    if missing:
        raise ProfileError(f"profile {default_name!r}: missing keys {missing}")
    try:
        return Profile(**values)
    except TypeError as exc:
        raise ProfileError(f"profile {default_name!r}: {exc}") from exc


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> Profile:
    """Load a bundled profile by name, or a profile TOML file by path."""
    path = _resolve(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    return profile_from_dict(data, path.stem)


def list_profiles() -> list[str]:
    """Names of the bundled profiles."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
