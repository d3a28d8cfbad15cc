"""`kvgate bench NAME [ARGS...]`: every benchmark behind one command.

    kvgate bench peers --trace ../shared/traces/claude-code --sessions-concurrent 16,32
    kvgate bench peers --overhead
    kvgate bench gateway
    kvgate bench simulator
    kvgate bench simulator-memory [--speed]
    kvgate bench index
    kvgate bench polls [--replicas 512]
    kvgate bench hashing
    kvgate bench NAME --help

Each benchmark is its own module (`BENCHES`), imported only when it runs. A module with
``add_arguments(parser)`` and ``run(args)`` gets a parser named ``kvgate bench NAME``;
a module with only ``main(argv)`` is called with the remaining arguments.
Results of the last runs on the project machine: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "peers": (
        "loadtest.bench_peers",
        "kvgate vs sglang-router 0.3.2 and smg 1.13.0 on one workload and fleet (--overhead)",
    ),
    "gateway": (
        "loadtest.bench_gateway",
        "latency and CPU the gateway adds over calling a replica directly",
    ),
    "simulator": (
        "loadtest.bench_simulator",
        "requests/s one simulated replica takes with ~400 KB prompts",
    ),
    "simulator-memory": (
        "loadtest.bench_simulator_memory",
        "simulated replica: cache-index memory, virtual-time speed (--speed)",
    ),
    "index": ("loadtest.bench_index", "prefix index lookups: in-memory and Redis backends"),
    "polls": ("loadtest.bench_polls", "a large fleet's probes and load polls: in batches against all at once"),
    "hashing": ("loadtest.bench_hashing", "request parsing and block hashing cost per body size"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = "\n".join(f"  {name:<18}{help_text}" for name, (_, help_text) in BENCHES.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        f"benchmarks:\n{names}\n\n`kvgate bench NAME --help` shows a benchmark's options."
    )
    parser.add_argument(
        "bench", choices=list(BENCHES), metavar="NAME", help="benchmark to run (below)"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")


def run_bench(name: str, argv: Sequence[str]) -> int:
    """Import benchmark ``name`` and run it with ``argv``; returns its exit code.

    ``sys.argv`` is set to what ``python -m MODULE ARGV`` would see while it runs: some
    benchmarks print their own command line from it.
    """
    module_name, help_text = BENCHES[name]
    module = importlib.import_module(module_name)
    saved, sys.argv = sys.argv, [module_name, *argv]
    try:
        if hasattr(module, "add_arguments") and hasattr(module, "run"):
            parser = argparse.ArgumentParser(prog=f"kvgate bench {name}", description=help_text)
            module.add_arguments(parser)
            code: int = module.run(parser.parse_args(list(argv)))
            return code
        main_code: int = module.main(list(argv))
        return main_code
    finally:
        sys.argv = saved


def run(args: argparse.Namespace) -> int:
    return run_bench(args.bench, args.args)
