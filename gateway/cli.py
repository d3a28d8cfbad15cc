"""`kvgate` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so the
serving path (`kvgate serve`) never imports the load-test harness or the simulator.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

# name -> (module path, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve_cmd", "run the gateway (OpenAI-compatible endpoint)"),
    "sim": ("loadtest.simulator.cli", "run simulated SGLang replicas"),
    "demo": ("loadtest.demo", "simulated fleet + gateway + real sessions, policies side by side"),
    "loadtest": ("loadtest.cli", "replay a workload against an OpenAI-compatible endpoint"),
    "simulate": ("loadtest.simulate_cmd", "simulate a whole fleet over a trace in virtual time"),
    "bench": ("loadtest.bench_cmd", "benchmarks (peers, gateway overhead, index, simulator)"),
    "drain": ("replicas.drain_cmd", "ask a gateway to drain a replica and wait (preStop hook)"),
    "sglang-cpu": ("loadtest.sglang_cpu.cli", "run real SGLang 0.5.23 servers on the CPU with a tiny local model"),
    "sglang-args": ("replicas.sglang_args", "generate SGLang launch arguments from a replica profile"),
}
# the `bench` extra's packages and the harness itself (absent from the gateway image): never serving's
BENCH_EXTRA = frozenset({"rich", "matplotlib", "uvicorn", "loadtest"})


def installed_version() -> str:
    """The installed distribution's version (``pyproject.toml``), or ``unknown`` when run from
    a source tree that was never installed."""
    try:
        return version("kvgate")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="Cache-aware LLM inference gateway")
    parser.add_argument("--version", action="version", version=f"kvgate {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # arguments are added lazily (see main) so that --help of one command does not
        # import every other one
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``argv``: the arguments (default: this program's own, ``sys.argv``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:  # also --version and --help
        args = parser.parse_args(argv)
        parser.print_help()
        return 2
    name = argv[0]
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in BENCH_EXTRA:
            raise
        print(f"kvgate {name} needs the harness's extra ({exc.name} is missing): pip install 'kvgate[bench]'",
              file=sys.stderr)
        return 2
    sub_parser = argparse.ArgumentParser(prog=f"kvgate {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    result: int = module.run(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
