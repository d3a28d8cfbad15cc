"""Benchmark: parse + canonical rendering + chained hashing of a ~400 KB chat body (issue 3 item 5).

The body looks like a coding agent's turn: a long system prompt, tool schemas, then
user / assistant-with-tool-call / tool-result turns until it reaches ``--kb`` KB
(seeded, code-like text). Measured on one core (the process is pinned to CPU 0 when
possible): ``build_context`` p50/p99 wall and CPU, and its parts (orjson parse, render,
hash).

    python -m loadtest.bench_hashing [--kb 400] [--iterations 500]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gateway import conversation, prefix_hash
from gateway.context import ContextConfig, build_context
from loadtest.percentile import percentile

WORDS = ["def", "class", "return", "import", "self", "value", "None", "if", "else", "for", "in", "while", "try", "except", "with", "as", "yield", "lambda"]
CODE = WORDS + ["(", ")", ":", "=", "==", "+", "[", "]", "{", "}", "\n", "    ", "x", "y", "path", "data", "result"]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(CODE) for _ in range(n_words))


def make_body(kb: int, seed: int = 0) -> bytes:
    """A chat request of about ``kb`` KB, shaped like an agent's turn."""
    rng = random.Random(seed)
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": _text(rng, 40),
                                               "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}}
             for i in range(12)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, 3000)}]
    i = 0
    while len(orjson.dumps(messages)) < kb * 1000 - 4000:
        messages.append({"role": "user", "content": _text(rng, 120)})
        messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
                         "function": {"name": "tool_1", "arguments": orjson.dumps({"arg": _text(rng, 20)}).decode()}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": [{"type": "text", "text": _text(rng, 500)}]})
        i += 1
    return orjson.dumps({"model": "qwen3-coder", "messages": messages, "tools": tools, "stream": True, "max_tokens": 1024})


def _measure(fn: Callable[[], object], n: int) -> tuple[list[float], list[float]]:
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return sorted(wall), sorted(cpu)


def _line(name: str, wall: list[float], cpu: list[float]) -> str:
    def pct(s: list[float], q: float) -> float:
        return (percentile(s, q * 100) or 0.0) * 1e6

    return (f"{name:14s} wall p50 {pct(wall, .5):7.0f} us  p99 {pct(wall, .99):7.0f} us   "
            f"cpu p50 {pct(cpu, .5):7.0f} us  p99 {pct(cpu, .99):7.0f} us")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kb", type=int, default=400, help="body size in KB")
    parser.add_argument("--iterations", type=int, default=500)


def run(args: argparse.Namespace) -> int:
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {0})  # one core
    body = make_body(args.kb)
    cfg = ContextConfig()
    headers = {"x-claude-code-session-id": "bench"}
    ctx = build_context("chat", body, headers, "application/json", cfg)
    data = orjson.loads(body)
    text = conversation.render_chat(data["messages"], data["tools"])
    raw = text.encode()
    print(f"body {len(body):,} bytes, {len(data['messages'])} messages, {ctx.prompt_chars:,} rendered chars, "
          f"{len(ctx.block_hashes)} blocks of {cfg.hashing.block_chars} bytes; {args.iterations} iterations")
    n = args.iterations
    print(_line("build_context", *_measure(lambda: build_context("chat", body, headers, "application/json", cfg), n)))
    print(_line("  orjson.loads", *_measure(lambda: orjson.loads(body), n)))
    print(_line("  render", *_measure(lambda: conversation.render_chat(data["messages"], data["tools"]).encode(), n)))
    print(_line("  hash chain", *_measure(lambda: prefix_hash.chain_hashes(raw, "qwen3-coder", 256, 8192), n)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_hashing", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
