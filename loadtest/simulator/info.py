"""Introspection bodies of a simulated replica: /server_info, /model_info, /v1/models, /v1/loads.

Shapes follow the SGLang 0.5.23 contract (§1.2-1.5). ``/server_info`` is a flat object
of resolved server arguments (the subset a gateway or a peer router reads, not all ~546)
plus the scheduler handshake fields, ``kv_events`` (the publisher descriptor of
``--kv-events-config``, or null: ``kv_publisher.descriptor``), ``internal_states`` and
``version``; one extra key, ``kvgate_sim``, names the profile and time scale.

``model_path`` is an existing local directory holding a minimal ``config.json`` and a
real Hugging Face tokenizer whose counts equal the simulator's (:mod:`.hf_tokenizer`):
peer routers and benchmark clients load a tokenizer from it and would otherwise try a
model hub.

Engine figures come from ``ReplicaEngine.snapshot()`` (an ``EngineStats``); the two
adapters :func:`scheduler_sample` and :func:`load_entry` are the only code that reads it.
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from loadtest.simulator.config import SimServerConfig
from loadtest.simulator.engine import EngineStats
from loadtest.simulator.hf_tokenizer import write_tokenizer
from loadtest.simulator.kv_publisher import KvEventsConfig, descriptor
from loadtest.simulator.metrics import SchedulerSample
from loadtest.simulator.profile import Profile

VERSION = "0.5.23"
ACCELERATOR = "Simulated GPU"
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
# /model_info "embedding" of a generation model, as the real 0.5.23 server reports it
# (capture_batch_sizes abbreviated)
NOT_EMBEDDING: dict[str, Any] = {
    "family": "none", "task": "none", "execution": "none", "attention": "none",
    "pooling": "model_defined", "normalize": False, "postprocessor": "none",
    "tokenizer_special_tokens": "model_default", "supports_dimensions": False,
    "supports_token_embeddings": False, "supports_multimodal": False,
    "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False, "safe_disable_radix_cache": False,
    "safe_disable_chunked_prefill": False, "enabled": False, "matryoshka_dimensions": [],
    "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 4096,
            "capture_batch_sizes": [4, 8, 12, 16, 20, 24, 28, 32]},
    "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False,
              "chunked_prefill_disabled": False},
}


def model_dir(profile: Profile) -> Path:
    return Path(tempfile.gettempdir()) / "kvgate-sim-models" / profile.served_model_name


def write_model_dir(path: Path, profile: Profile) -> None:
    """Create the local model folder (a minimal HF ``config.json``); atomic, idempotent."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
              "max_position_embeddings": profile.context_length, "vocab_size": 163840,
              "eos_token_id": 163586, "_name_or_path": profile.model_path or profile.name}
    tmp = path / f".config.json.{os.getpid()}"
    tmp.write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path / "config.json")
    write_tokenizer(path, profile.context_length)


def server_args(config: SimServerConfig, model_path: Path) -> dict[str, Any]:
    """The resolved ServerArgs subset reported by /server_info (static for the process)."""
    p = config.profile
    hicache = p.host_tokens > 0
    spec = p.spec_algorithm
    return {
        "model_path": str(model_path), "tokenizer_path": str(model_path),
        "served_model_name": p.served_model_name, "host": config.host, "port": config.port,
        "skip_tokenizer_init": False, "trust_remote_code": True, "is_embedding": False,
        "tp_size": p.tp_size, "dp_size": 1, "attn_dp_size": 1, "pp_size": 1, "ep_size": 1,
        "dcp_size": 1, "enable_dp_attention": False, "page_size": p.page_size,
        "context_length": p.context_length, "mem_fraction_static": 0.85,
        "chunked_prefill_size": p.chunked_prefill_size,
        "max_running_requests": p.max_running_requests, "max_queued_requests": None,
        "schedule_policy": "fcfs", "radix_eviction_policy": "lru", "disable_radix_cache": False,
        "enable_hierarchical_cache": hicache,
        "hicache_ratio": round(p.host_tokens / p.device_tokens, 4) if hicache else 2.0,
        "hicache_size": 0, "hicache_write_policy": "write_through", "hicache_io_backend": "kernel",
        "hicache_mem_layout": "page_first", "hicache_storage_backend": None,
        "speculative_algorithm": spec, "speculative_draft_model_path": None,
        "speculative_num_steps": 1 if spec else None, "speculative_eagle_topk": 1 if spec else None,
        "speculative_num_draft_tokens": p.spec_num_draft_tokens if spec else None,
        "kv_events_config": _kv_events_arg(config), "enable_cache_report": True, "enable_metrics": True,
        "decode_log_interval": 40, "stream_interval": 1, "watchdog_timeout": 300,
        "tool_call_parser": "kimi_k2", "reasoning_parser": "kimi_k2", "load_format": "auto",
        "weight_version": "default", "disaggregation_mode": "null",
        "launch_command": " ".join(shlex.quote(a) for a in sys.argv),
        "kvgate_sim": {"profile": p.name, "time_scale": config.time_scale, "seed": config.seed},
    }


def kv_events(args: dict[str, Any]) -> dict[str, Any] | None:
    """``/server_info.kv_events``: the descriptor of ``kv_events_config`` (SGLang's block
    size: ``page_size * dcp_size``)."""
    raw = args.get("kv_events_config")
    if not isinstance(raw, str):
        return None
    block = int(args.get("page_size") or 0) * int(args.get("dcp_size") or 1)
    return descriptor(KvEventsConfig.from_json(raw), block)


def _kv_events_arg(config: SimServerConfig) -> str | None:
    """``kv_events_config`` as SGLang reports it: the flag's JSON string (None when unset)."""
    return None if config.kv_events is None else orjson.dumps(config.kv_events.to_json()).decode()


def server_info(args: dict[str, Any], stats: EngineStats, profile: Profile,
                started_wall_s: float) -> dict[str, Any]:
    memory = {"weight": profile.weight_gb_per_gpu, "kvcache": _kv_gb(profile),
              "startup_available": 0.0, "token_capacity": profile.device_tokens,
              "token_capacity_swa": None, "graph": dict.fromkeys(GRAPH_PHASES, 0.0)}
    state_args = {k: v for k, v in args.items() if k != "launch_command"}
    state: dict[str, Any] = {**state_args, "world_size": profile.tp_size,
                             "effective_max_running_requests_per_dp": profile.max_running_requests,
                             "last_gen_throughput": stats.gen_throughput, "memory_usage": memory,
                             "disaggregation_mode": "null", "decode_cuda_graph_bs": [],
                             "decode_cuda_graph_memory_gb": 0.0}
    if profile.spec_algorithm and stats.spec_accept_length_avg:
        state["avg_spec_accept_length"] = stats.spec_accept_length_avg
    return {
        **args, "status": "ready", "max_total_num_tokens": profile.device_tokens,
        "max_req_input_len": profile.context_length - 1,
        "hicache_object_layout": _object_layout(profile),
        "startup_time": {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
                         "cuda_graph": dict.fromkeys(GRAPH_PHASES, 0.0), "tokenizer_e2e": 0.0},
        "kv_events": kv_events(args), "internal_states": [state], "version": VERSION, "frontend": "python",
    }


def model_info(profile: Profile, path: Path) -> dict[str, Any]:
    return {"model_path": str(path), "served_model_name": profile.served_model_name,
            "tokenizer_path": str(path), "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "load_format": "auto", "reasoning_parser": "kimi_k2",
            "tool_call_parser": "kimi_k2", "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "embedding": NOT_EMBEDDING}


def model_card(profile: Profile, created: float) -> dict[str, Any]:
    name = profile.served_model_name
    return {"id": name, "object": "model", "created": int(created), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": profile.context_length}


def _object_layout(profile: Profile) -> dict[str, Any]:
    """``hicache_object_layout`` as 0.5.23 reports it (a descriptor, not a layout name)."""
    if profile.host_tokens > 0:
        return {"enabled": True, "backend": None, "page_size": profile.page_size,
                "hicache_object_layout": {"pools": []}, "reason": "Hierarchical cache is enabled"}
    return {"enabled": False, "backend": None, "page_size": profile.page_size,
            "hicache_object_layout": {"pools": []}, "reason": "Hierarchical cache is disabled"}


def _kv_gb(profile: Profile) -> float:
    return round(profile.device_tokens * profile.kv_bytes_per_token / profile.tp_size / 1e9, 3)


def _usage(stats: EngineStats, profile: Profile) -> float:
    return stats.token_usage


def scheduler_sample(stats: EngineStats, profile: Profile) -> SchedulerSample:
    return SchedulerSample(
        num_running_reqs=stats.num_running_reqs, num_queue_reqs=stats.num_waiting_reqs,
        gen_throughput=stats.gen_throughput, cache_hit_rate=stats.cache_hit_rate,
        token_usage=_usage(stats, profile), num_used_tokens=stats.num_used_tokens,
        max_total_num_tokens=profile.device_tokens, page_size=profile.page_size,
        context_len=profile.context_length, spec_accept_length=stats.spec_accept_length,
        spec_accept_rate=_accept_rate(stats.spec_accept_length, profile),
        hicache_host_used_tokens=stats.hicache_host_used_tokens,
        hicache_host_total_tokens=profile.host_tokens)


def _accept_rate(accept_length: float, profile: Profile) -> float:
    drafts = profile.spec_num_draft_tokens - 1
    return max(accept_length - 1.0, 0.0) / drafts if drafts > 0 else 0.0


def load_entry(stats: EngineStats, profile: Profile, include: set[str]) -> dict[str, Any]:
    """One ``loads[]`` entry of /v1/loads (``LoadSnapshot.to_dict`` key order)."""
    entry: dict[str, Any] = {
        "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": stats.num_running_reqs,
        "num_waiting_reqs": stats.num_waiting_reqs,
        "num_waiting_uncached_tokens": stats.num_waiting_uncached_tokens,
        "num_used_tokens": stats.num_used_tokens, "num_total_tokens": stats.num_total_tokens,
        "num_active_tokens": stats.num_total_tokens, "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": profile.device_tokens,
        "max_running_requests": profile.max_running_requests,
        "token_usage": round(_usage(stats, profile), 4), "gen_throughput": stats.gen_throughput,
        "cache_hit_rate": stats.cache_hit_rate,
        "utilization": stats.num_running_reqs / profile.max_running_requests,
        "total_prefill_uncached_tokens": stats.total_prefill_uncached_tokens,
        "total_prefill_busy_us": int(stats.total_prefill_busy_s * 1e6), "decode_moments": None,
    }
    if include & {"memory", "all"}:
        entry["memory"] = {"weight_gb": profile.weight_gb_per_gpu, "kv_cache_gb": _kv_gb(profile),
                           "graph_gb": 0.0, "token_capacity": profile.device_tokens}
    if include & {"spec", "all"} and profile.spec_algorithm and stats.spec_accept_length_avg:
        # SGLang's load_inquirer: accepted tokens / forward count over the scheduler's life
        # (its lifetime totals), present once speculative decoding ran a step
        entry["speculative"] = {"accept_length": stats.spec_accept_length_avg,
                                "accept_rate": _accept_rate(stats.spec_accept_length_avg, profile)}
    if include & {"disagg", "all"}:
        entry["disaggregation"] = {
            "mode": "null", "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0}
    if include & {"queues", "all"}:
        entry["queues"] = {"waiting": stats.num_waiting_reqs, "grammar": 0, "paused": 0, "retracted": 0,
                           "prealloc_ready": 0}
    return entry


def loads(stats: EngineStats, profile: Profile, include: str) -> dict[str, Any]:
    parts = {p.strip() for p in include.split(",") if p.strip()} or {"all"}
    return {"timestamp": datetime.now(UTC).isoformat(), "version": VERSION,
            "accelerator": ACCELERATOR, "num_accelerators": profile.tp_size,
            "loads": [load_entry(stats, profile, parts)]}


def loads_prometheus(body: dict[str, Any]) -> bytes:
    """``format=prometheus``: ``sglang_<field>{dp_rank="N"}`` and ``sglang_<spec|disagg>_<field>``."""
    lines: list[str] = []
    prefixes = {"speculative": "spec_", "disaggregation": "disagg_"}
    for entry in body["loads"]:
        label = f'{{dp_rank="{entry["dp_rank"]}"}}'
        for key, value in entry.items():
            if isinstance(value, dict) and key in prefixes:
                lines += [f"sglang_{prefixes[key]}{k}{label} {float(v)}" for k, v in value.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)]
            elif isinstance(value, (int, float)) and key not in ("dp_rank", "timestamp"):
                lines.append(f"sglang_{key}{label} {float(value)}")
    return ("\n".join(lines) + "\n").encode()
