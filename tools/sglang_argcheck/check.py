"""Validate `sglang serve` arguments with SGLang 0.5.23's own parser, on CPU.

Runs inside the CPU SGLang venv of ``tools/sglang_cpu/install.sh`` (the sglang wheel
with ``--no-deps``, CPU torch 2.13 and SGLang's non-CUDA requirements; see
``.ci/sglang-argcheck.sh``). It also works in a smaller venv without triton (contract
doc §7 recipe B). Two tricks make the parser importable without a GPU:

- ``sglang`` is registered as a bare package, so ``sglang/__init__.py`` (the frontend
  language: IPython, aiohttp, ...) never runs; ``sglang.srt.*`` imports normally.
- a meta-path finder stubs ``triton`` (SGLang's own macOS stub, ``_platform_stubs``).

Usage: ``python check.py [--] ARG...`` (the arguments after ``sglang serve``),
``python check.py --selftest``, or ``python check.py --batch`` with a JSON object
``{case: [ARG, ...]}`` on stdin, answering ``{case: {"status", "values" | "error"}}``
(one interpreter start for many cases: importing torch dominates the cost). Builds ``argparse.ArgumentParser(allow_abbrev=False)``
plus ``ServerArgs.add_cli_args``, parses, checks ``SpeculativeAlgorithm.from_string``
and ``KVEventsConfig.from_cli``, and prints JSON of the key parsed values. Exit 0 when
valid, 2 when the parser rejects the arguments (its message on stderr), 3 on a
semantic error found by SGLang's helpers.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import sys
import types
from pathlib import Path
from typing import Any

KEYS = (
    "model_path", "served_model_name", "host", "port", "tp_size", "pp_size", "page_size",
    "mem_fraction_static", "context_length", "chunked_prefill_size", "max_running_requests",
    "enable_metrics", "enable_cache_report", "enable_hierarchical_cache", "hicache_ratio",
    "hicache_write_policy", "hicache_mem_layout", "hicache_io_backend", "speculative_algorithm",
    "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "speculative_dflash_block_size", "kv_events_config",
    "tool_call_parser", "reasoning_parser", "watchdog_timeout", "trust_remote_code",
)
SELFTEST_ARGS = ["--model-path", "m", "--tp-size", "8", "--page-size", "64"]


def install_shims() -> None:
    """Bare ``sglang`` package + triton stub (idempotent)."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("sglang is not installed in this interpreter (run .ci/sglang-argcheck.sh)")
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["sglang"] = pkg
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stubs: Any = importlib.import_module("sglang._platform_stubs")
    sys.meta_path.insert(0, stubs._TritonFinder())
    triton = stubs._make_mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv = stubs._cdiv
    triton.next_power_of_2 = stubs._next_power_of_2
    triton.Config = stubs._Config


def parse(argv: list[str]) -> dict[str, Any]:
    """Parse with SGLang's parser; SystemExit(2) on rejection; ValueError on semantics."""
    install_shims()
    from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found,unused-ignore]

    parser = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    values = {k: getattr(ns, k) for k in KEYS if hasattr(ns, k)}
    if ns.speculative_algorithm is not None:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # type: ignore[import-not-found,unused-ignore]

        values["speculative_algorithm_resolved"] = SpeculativeAlgorithm.from_string(ns.speculative_algorithm).name
    if ns.kv_events_config:
        from sglang.srt.disaggregation.kv_events import KVEventsConfig  # type: ignore[import-not-found,unused-ignore]

        cfg = KVEventsConfig.from_cli(ns.kv_events_config)
        values["kv_events_resolved"] = {"publisher": cfg.publisher, "endpoint": cfg.endpoint, "topic": cfg.topic,
                                        "replay_endpoint": cfg.replay_endpoint}
    import sglang.version  # type: ignore[import-not-found,unused-ignore]

    values["sglang_version"] = sglang.version.__version__
    return values


def check_one(argv: list[str]) -> dict[str, Any]:
    """Status 0 with the parsed values, 2 (parser rejected) or 3 (semantic) with the error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return {"status": 0, "values": parse(argv)}
    except SystemExit as e:
        return {"status": e.code if isinstance(e.code, int) else 2, "error": err.getvalue()[-1000:]}
    except ValueError as e:
        return {"status": 3, "error": str(e)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--batch"]:
        cases: dict[str, list[str]] = json.load(sys.stdin)
        print(json.dumps({name: check_one(args) for name, args in cases.items()}, default=str, sort_keys=True))
        return 0
    if argv[:1] == ["--selftest"]:
        argv = SELFTEST_ARGS
    elif argv[:1] == ["--"]:
        argv = argv[1:]
    try:
        values = parse(argv)
    except ValueError as e:
        print(f"semantic error: {e}", file=sys.stderr)
        return 3
    print(json.dumps(values, default=str, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main(sys.argv[1:]))
