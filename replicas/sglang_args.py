"""SGLang 0.5.23 launch arguments generated from a replica profile (`kvgate sglang-args`).

A *replica profile* (``replicas/sglang_profiles/<name>.toml``) names the deployment
choices of one SGLang replica: model, parallelism, memory, HiCache, speculative
decoding, serving flags. :func:`build_args` turns it into ``sglang serve`` arguments
with canonical long flag names (argparse would accept abbreviations such as ``--tp``;
we never emit them), and :func:`semantic_errors` checks what SGLang's argparse does not
(contract doc §4, §6): DFLASH needs a draft path and ``pp_size == 1`` and leaves
steps/topk unset; the EAGLE family needs steps, topk and draft tokens; the page size is
explicit (it is the KV-event block size); a HiCache ratio is above 1.

The checked-in deployment files listed in :data:`GENERATED` are rendered from profiles;
``kvgate sglang-args --write`` regenerates them and ``--check`` (run by the tests) fails
when one is stale. Argparse-level validation against SGLang's own parser lives in
``tools/sglang_argcheck/check.py`` (a separate venv; see ``.ci/sglang-argcheck.sh``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped,unused-ignore]

PROFILE_DIR = Path(__file__).resolve().parent / "sglang_profiles"
REPO_ROOT = Path(__file__).resolve().parents[1]
SGLANG_VERSION = "0.5.23"
# overlay file (relative to the repo root) -> (profile, Deployment name, container name)
GENERATED: dict[str, tuple[str, str, str]] = {
    "deploy/overlays/gpu-fleet/sglang-args.generated.yaml": ("kimi-k2.6-tp8-dflash", "sglang", "sglang"),
}
EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3", "NEXTN", "FROZEN_KV_MTP"})
KNOWN_ALGORITHMS = EAGLE_FAMILY | {"STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO"}
HICACHE_WRITE_POLICIES = frozenset({"write_back", "write_through", "write_through_selective"})
HICACHE_IO_BACKENDS = frozenset({"direct", "kernel", "kernel_ascend"})
HICACHE_LAYOUTS = frozenset({"layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"})


@dataclass(frozen=True)
class SGLangProfile:
    """One replica's deployment choices; every key of the TOML file is a field here."""

    name: str
    model_path: str
    served_model_name: str
    page_size: int
    description: str = ""
    trust_remote_code: bool = False
    context_length: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    gpus: int = 1
    tp_size: int = 1
    pp_size: int = 1
    mem_fraction_static: float | None = None
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    hicache: bool = False
    hicache_ratio: float | None = None
    hicache_write_policy: str = "write_through"
    hicache_mem_layout: str = "page_first"
    hicache_io_backend: str = "kernel"
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_dflash_block_size: int | None = None
    host: str = "0.0.0.0"
    port: int = 30000
    enable_metrics: bool = True
    enable_cache_report: bool = True
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None  # the ROUTER replaying buffered batches (rank r: port + r)
    kv_events_topic: str = ""
    watchdog_timeout: int | None = None
    extra_args: tuple[str, ...] = ()


class LaunchProfileError(ValueError):
    """A profile that cannot be loaded or fails the semantic checks."""


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> SGLangProfile:
    """Load ``sglang_profiles/<name>.toml`` (or a path); unknown keys are an error."""
    path = Path(name_or_path)
    if path.suffix != ".toml":  # a name (names may hold dots: kimi-k2.6-...)
        path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise LaunchProfileError(f"no SGLang profile {name_or_path!r} (known: {', '.join(profile_names())})")
    raw: dict[str, Any] = tomllib.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(SGLangProfile)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise LaunchProfileError(f"{path.name}: unknown keys {unknown}")
    raw.setdefault("name", path.stem)
    if "extra_args" in raw:
        raw["extra_args"] = tuple(raw["extra_args"])
    try:
        return SGLangProfile(**raw)
    except TypeError as e:
        raise LaunchProfileError(f"{path.name}: {e}") from e


def _speculative_errors(p: SGLangProfile) -> list[str]:
    algo = (p.speculative_algorithm or "").upper()
    if not algo:
        return []
    if algo not in KNOWN_ALGORITHMS:
        return [f"unknown speculative algorithm {p.speculative_algorithm!r}"]
    errors: list[str] = []
    if algo == "DFLASH":
        if not p.speculative_draft_model_path:
            errors.append("DFLASH needs speculative_draft_model_path")
        if p.pp_size != 1:
            errors.append("DFLASH needs pp_size == 1")
        if p.speculative_num_steps is not None or p.speculative_eagle_topk is not None:
            errors.append("DFLASH forces steps/topk to 1: leave speculative_num_steps/eagle_topk unset")
        bs, nd = p.speculative_dflash_block_size, p.speculative_num_draft_tokens
        if bs is not None and nd is not None and bs != nd:
            errors.append("DFLASH: speculative_dflash_block_size must equal speculative_num_draft_tokens")
    elif p.speculative_dflash_block_size is not None:
        errors.append("speculative_dflash_block_size applies to DFLASH only")
    if algo in EAGLE_FAMILY:
        if algo in {"EAGLE", "EAGLE3"} and not p.speculative_draft_model_path:
            errors.append(f"{algo} needs speculative_draft_model_path")
        for key in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
            if getattr(p, key) is None:
                errors.append(f"{algo} needs {key}")
        steps, topk, nd = p.speculative_num_steps, p.speculative_eagle_topk, p.speculative_num_draft_tokens
        if topk == 1 and steps is not None and nd is not None and nd != steps + 1:
            errors.append(f"{algo} with topk 1 needs num_draft_tokens == num_steps + 1")
    return errors


def _hicache_errors(p: SGLangProfile) -> list[str]:
    if not p.hicache:
        return []
    errors: list[str] = []
    if p.hicache_ratio is not None and p.hicache_ratio <= 1.0:
        errors.append("hicache_ratio must be > 1 (the host pool is a multiple of the device pool)")
    if p.hicache_write_policy not in HICACHE_WRITE_POLICIES:
        errors.append(f"hicache_write_policy {p.hicache_write_policy!r} not in {sorted(HICACHE_WRITE_POLICIES)}")
    if p.hicache_io_backend not in HICACHE_IO_BACKENDS:
        errors.append(f"hicache_io_backend {p.hicache_io_backend!r} not in {sorted(HICACHE_IO_BACKENDS)}")
    if p.hicache_mem_layout not in HICACHE_LAYOUTS:
        errors.append(f"hicache_mem_layout {p.hicache_mem_layout!r} not in {sorted(HICACHE_LAYOUTS)}")
    return errors


def semantic_errors(p: SGLangProfile) -> list[str]:
    """What SGLang's argparse accepts but resolution (or a gateway) would reject."""
    errors = _speculative_errors(p) + _hicache_errors(p)
    if p.page_size < 1:
        errors.append("page_size must be explicit and >= 1 (it is the KV-event block size)")
    if p.tp_size < 1 or p.pp_size < 1 or p.tp_size * p.pp_size != p.gpus:
        errors.append(f"tp_size*pp_size ({p.tp_size}*{p.pp_size}) must equal gpus ({p.gpus})")
    if p.mem_fraction_static is not None and not 0.0 < p.mem_fraction_static < 1.0:
        errors.append("mem_fraction_static must be in (0, 1)")
    for key in ("context_length", "chunked_prefill_size", "max_running_requests", "watchdog_timeout"):
        value = getattr(p, key)
        if value is not None and value < 1:
            errors.append(f"{key} must be >= 1")
    if not p.served_model_name:
        errors.append("served_model_name must be set (the gateway routes by model name)")
    if not p.enable_cache_report:
        errors.append("enable_cache_report must be on (cached-token feedback for the gateway)")
    return errors


# (flag, profile field) in output order. A True bool is a bare flag; None and False are
# left out. HiCache and speculative flags only when enabled.
_MAIN = (
    ("--model-path", "model_path"), ("--trust-remote-code", "trust_remote_code"),
    ("--served-model-name", "served_model_name"), ("--host", "host"), ("--port", "port"),
    ("--tp-size", "tp_size"), ("--pp-size", "pp_size"), ("--mem-fraction-static", "mem_fraction_static"),
    ("--context-length", "context_length"), ("--page-size", "page_size"),
    ("--chunked-prefill-size", "chunked_prefill_size"), ("--max-running-requests", "max_running_requests"),
    ("--enable-metrics", "enable_metrics"), ("--enable-cache-report", "enable_cache_report"),
)
_HICACHE = (
    ("--enable-hierarchical-cache", "hicache"), ("--hicache-ratio", "hicache_ratio"),
    ("--hicache-write-policy", "hicache_write_policy"), ("--hicache-mem-layout", "hicache_mem_layout"),
    ("--hicache-io-backend", "hicache_io_backend"),
)
_SPECULATIVE = (
    ("--speculative-algorithm", "speculative_algorithm"),
    ("--speculative-draft-model-path", "speculative_draft_model_path"),
    ("--speculative-num-steps", "speculative_num_steps"), ("--speculative-eagle-topk", "speculative_eagle_topk"),
    ("--speculative-num-draft-tokens", "speculative_num_draft_tokens"),
    ("--speculative-dflash-block-size", "speculative_dflash_block_size"),
)
_TAIL = (
    ("--tool-call-parser", "tool_call_parser"), ("--reasoning-parser", "reasoning_parser"),
    ("--watchdog-timeout", "watchdog_timeout"),
)


def _emit(p: SGLangProfile, table: tuple[tuple[str, str], ...]) -> list[str]:
    out: list[str] = []
    for flag, key in table:
        value = getattr(p, key)
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out.extend([flag, str(value)])
    return out


def build_args(p: SGLangProfile) -> list[str]:
    """``sglang serve`` arguments (after ``serve``), canonical long names, fixed order."""
    errors = semantic_errors(p)
    if errors:
        raise LaunchProfileError(f"profile {p.name}: " + "; ".join(errors))
    out = _emit(p, _MAIN)
    if p.hicache:
        out += _emit(p, _HICACHE)
    if p.speculative_algorithm:
        out += _emit(dataclasses.replace(p, speculative_algorithm=p.speculative_algorithm.upper()), _SPECULATIVE)
    if p.kv_events_endpoint:
        cfg = {"publisher": "zmq", "endpoint": p.kv_events_endpoint, "topic": p.kv_events_topic}
        if p.kv_events_replay_endpoint:
            cfg["replay_endpoint"] = p.kv_events_replay_endpoint
        out += ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]
    return out + _emit(p, _TAIL) + list(p.extra_args)


def render_patch(p: SGLangProfile, deployment: str, container: str) -> str:
    """A kustomize strategic-merge patch setting the container's command, args and GPUs."""
    gpus = str(p.gpus)
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment},
        "spec": {"template": {"spec": {"containers": [{
            "name": container,
            "command": ["sglang", "serve"],
            "args": build_args(p),
            "resources": {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}},
        }]}}},
    }
    header = (
        f"# GENERATED by `kvgate sglang-args --write` from replicas/sglang_profiles/{p.name}.toml\n"
        f"# (SGLang {SGLANG_VERSION}). Do not edit: change the profile and regenerate;\n"
        "# `kvgate sglang-args --check` (run by the tests) fails when this file is stale.\n"
    )
    body: str = yaml.safe_dump(patch, sort_keys=False, width=1000)
    return header + body


def stale_files(root: Path = REPO_ROOT) -> list[str]:
    """Generated files whose checked-in content differs from what the profiles give."""
    stale: list[str] = []
    for rel, (profile, deployment, container) in GENERATED.items():
        path = root / rel
        want = render_patch(load_profile(profile), deployment, container)
        if not path.is_file() or path.read_text() != want:
            stale.append(rel)
    return stale


def write_files(root: Path = REPO_ROOT) -> list[str]:
    written: list[str] = []
    for rel, (profile, deployment, container) in GENERATED.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_patch(load_profile(profile), deployment, container))
        written.append(rel)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="kimi-k2.6-tp8-dflash", help="profile name or .toml path")
    parser.add_argument("--format", choices=("shell", "json", "patch"), default="shell",
                        help="shell: a `sglang serve` command; json: the argument list; patch: kustomize patch")
    parser.add_argument("--list", action="store_true", help="list the known profiles")
    parser.add_argument("--write", action="store_true", help="regenerate the checked-in generated files")
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (for --write/--check)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.list:
            for name in profile_names():
                print(f"{name}: {load_profile(name).description}")
        elif args.check:
            stale = stale_files(args.root)
            for rel in stale:
                print(f"stale: {rel} (run `kvgate sglang-args --write`)", file=sys.stderr)
            if not stale:
                print(f"ok: {len(GENERATED)} generated file(s) current")
            return 1 if stale else 0
        elif args.write:
            for rel in write_files(args.root):
                print(f"wrote {rel}")
        else:
            profile = load_profile(args.profile)
            if args.format == "json":
                print(json.dumps(build_args(profile)))
            elif args.format == "patch":
                print(render_patch(profile, "sglang", "sglang"), end="")
            else:
                print(shlex.join(["sglang", "serve", *build_args(profile)]))
    except LaunchProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
