"""Benchmark: parse + canonical rendering + chained hashing of a ~400 KB chat body (issue 3 item 5).

The body looks like a coding agent's turn: a long system prompt, tool schemas, then
user / assistant-with-tool-call / tool-result turns until it reaches ``--kb`` KB
(seeded, code-like text). Measured on one core (the process is pinned to CPU 0 when
possible): ``build_context`` p50/p99 wall and CPU, and its parts (orjson parse, render,
hash).

    python -m loadtest.bench_hashing [--kb 400] [--iterations 500]
    kvgate bench hashing --turns [--kb 400] [--iterations 300]

``--turns`` measures the cache of earlier turns (issue 15, ``gateway.context_cache``): CPU
per ``build_context`` call (``time.process_time``) for a ``--kb`` KB Anthropic Messages body
(Claude Code's shape: ``cache_control`` on the newest message, moved each turn) and the
chat body above, as a *first turn* (nothing cached) and a *later turn* (the previous turn,
~2 KB shorter, built just before, untimed), with the cache off (before) and on (after),
in one run; the load average is printed with the table.
    kvgate bench hashing --precise [--tokenizer-dir DIR] [--page-sizes 1,64] [--iterations 200]

``--precise`` measures precise mode's request path instead (issues 13, 42): the chat
template, the tokenizer (``--tokenizer-dir``; default: both real SGLang CPU test models
cached on this machine, the ``tokenizer.json`` one and its TikToken-form twin), SGLang page
hashes and the event-index match over 8 replicas, per request, for a *first turn* (nothing
cached: the whole body tokenized and hashed) and a *later turn* (the session's previous
turn, 3 messages shorter, cached: only the new messages are tokenized and hashed). This is
the work of the gateway's tokenizer pool, measured in one thread; CPU and wall.

    kvgate bench hashing --precise --gateway [--tokenizer-dir DIR] [--kb 400] [--duration-s 30] [--big-rate 2]

``--gateway`` measures instead what that work costs the other requests of a running
gateway: a small request's added latency while 400 KB first turns are tokenized
(``loadtest/bench_precise_gateway.py``).
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
from gateway.context import ContextConfig, HashingConfig, build_context
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


def make_messages_body(kb: int, seed: int = 0, turns_back: int = 0) -> bytes:
    """An Anthropic Messages request of about ``kb`` KB, shaped like a Claude Code turn:
    system blocks and tools with ``cache_control``, then user / assistant tool_use / user
    tool_result turns; the newest message carries the ``cache_control`` marker. With
    ``turns_back`` = 1: the same conversation one tool round (~2 KB) earlier."""
    rng = random.Random(seed)
    mark = {"type": "ephemeral"}
    tools = [{"name": f"tool_{i}", "description": _text(rng, 40),
              "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}}} for i in range(12)]
    tools[-1]["cache_control"] = mark
    system = [{"type": "text", "text": _text(rng, 3000), "cache_control": mark}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": _text(rng, 120)}]}]
    while len(orjson.dumps(messages)) < kb * 1000 - 6000:
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": _text(rng, 30)},
            {"type": "tool_use", "id": f"toolu_{len(messages)}", "name": "tool_1", "input": {"arg": _text(rng, 20)}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{len(messages) - 1}", "content": _text(rng, 250)}]})
    messages = messages[:len(messages) - 2 * turns_back]
    last = messages[-1]["content"][-1]
    messages[-1] = {**messages[-1], "content": [*messages[-1]["content"][:-1], {**last, "cache_control": mark}]}
    return orjson.dumps({"model": "claude-sonnet-4-5", "messages": messages, "system": system, "tools": tools,
                         "metadata": {"user_id": "user_bench_session"}, "max_tokens": 32000, "stream": True})


def run_turns(args: argparse.Namespace) -> int:
    """CPU per build_context: first and later turns, cache off and on (see the module docstring)."""
    n = args.iterations
    chat = orjson.loads(make_body(args.kb))
    bodies = {
        "messages": (make_messages_body(args.kb, turns_back=1), make_messages_body(args.kb)),
        "chat": (orjson.dumps({**chat, "messages": chat["messages"][:-3]}), orjson.dumps(chat)),
    }
    headers = {"x-claude-code-session-id": "bench"}
    load = os.getloadavg()
    print(f"build_context CPU per request (time.process_time, {n} requests a row); load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'api':9s} {'turn':6s} {'cache':6s} {'body':>9s} {'mean':>9s} {'p50':>9s} {'p99':>9s}")
    for api, (earlier, body) in bodies.items():
        for turn in ("first", "later"):
            rows = _turn_cpu(api, earlier if turn == "later" else None, body, headers, n)
            for cache, cpu in zip(("off", "on"), rows, strict=True):
                mean = sum(cpu) / len(cpu)
                print(f"{api:9s} {turn:6s} {cache:6s} {len(body):9,d} {mean * 1e6:7.0f}us "
                      f"{_q(cpu, .5) * 1e6:7.0f}us {_q(cpu, .99) * 1e6:7.0f}us")
    return 0


def _q(sorted_values: list[float], q: float) -> float:
    return percentile(sorted_values, q * 100) or 0.0


def _turn_cpu(api: str, earlier: bytes | None, body: bytes, headers: dict[str, str], n: int
              ) -> tuple[list[float], list[float]]:
    """CPU of ``build_context(body)``, cache off and on, interleaved (both see the same
    machine); before each, untimed: a fresh cache that has seen ``earlier``."""
    off: list[float] = []
    on: list[float] = []
    for _ in range(n):
        for cpu, entries in ((off, 0), (on, 4096)):
            cfg = ContextConfig(hashing=HashingConfig(prefix_cache_entries=entries))
            if earlier is not None:
                build_context(api, earlier, headers, "application/json", cfg)
            c = time.process_time()
            build_context(api, body, headers, "application/json", cfg)
            cpu.append(time.process_time() - c)
    return sorted(off), sorted(on)


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
    parser.add_argument("--precise", action="store_true", help="precise mode: tokenize + page-hash cost")
    parser.add_argument("--turns", action="store_true", help="first vs later turns, cache of earlier turns off/on")
    parser.add_argument("--tokenizer-dir", default=None, help="--precise: a model dir with tokenizer.json")
    parser.add_argument("--page-sizes", default="1,64", help="--precise: SGLang page sizes to measure")
    parser.add_argument("--gateway", action="store_true",
                        help="--precise: a small request's added latency through a running gateway while "
                             "--kb first turns are tokenized (loadtest/bench_precise_gateway.py)")
    parser.add_argument("--duration-s", type=float, default=30.0,
                        help="--gateway: seconds of small requests per phase (idle, busy)")
    parser.add_argument("--big-rate", type=float, default=2.0,
                        help="--gateway: big first turns per second (open loop)")
    parser.add_argument("--gateway-source", default=None, metavar="DIR",
                        help="--gateway: run the gateway from this source tree (PYTHONPATH), e.g. an "
                             "unpacked `git archive HEAD`, to measure the code before a change")
    parser.add_argument("--bench-page", type=int, default=64,
                        help="--gateway: the replica's KV page size (Kimi K2.6's launch profile: 64)")
    parser.add_argument("--gateway-set", action="append", default=[], metavar="KEY=VALUE",
                        help="--gateway: extra `kvgate serve --set` (repeatable)")


def run(args: argparse.Namespace) -> int:
    if args.precise and args.gateway:
        from loadtest.bench_precise_gateway import run_gateway_bench

        directory = args.tokenizer_dir or _default_tokenizer_dir()
        if directory is None:
            print("no tokenizer: pass --tokenizer-dir (a model dir)")
            return 2
        return run_gateway_bench(args, directory, make_body)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {0})  # one core
    if args.precise:
        return run_precise(args, make_body(args.kb))
    if args.turns:
        return run_turns(args)
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
    off = ContextConfig(hashing=HashingConfig(prefix_cache_entries=0))
    print(_line("build_context", *_measure(lambda: build_context("chat", body, headers, "application/json", off), n)))
    print(_line("  cached", *_measure(lambda: build_context("chat", body, headers, "application/json", cfg), n))
          + "   (the same body again: all of it cached; --turns for turns)")
    print(_line("  orjson.loads", *_measure(lambda: orjson.loads(body), n)))
    print(_line("  render", *_measure(lambda: conversation.render_chat(data["messages"], data["tools"]).encode(), n)))
    print(_line("  hash chain", *_measure(lambda: prefix_hash.chain_hashes(raw, "qwen3-coder", 256, 8192), n)))
    return 0


def _default_tokenizer_dir() -> str | None:
    found = _default_tokenizer_dirs()
    return found[0] if found else None


def _default_tokenizer_dirs() -> list[str]:
    """The real SGLang CPU test models cached on this machine: the ``tokenizer.json`` one, then
    its TikToken-form twin (``kvgate sglang-cpu --tokenizer tiktoken`` builds it)."""
    from loadtest.sglang_cpu.env import cache_dir

    out = []
    for pattern in ("sglang-cpu-*/models/tiny-llama-*/tokenizer.json", "sglang-cpu-*/models/tiny-kimi-*/tiktoken.model"):
        found = sorted(cache_dir().glob(pattern), key=lambda p: p.stat().st_mtime)
        if found:
            out.append(str(found[-1].parent))
    return out


def run_precise(args: argparse.Namespace, body: bytes) -> int:
    """Precise mode's per-request CPU: render + tokenize + page-hash + match, first and later turns,
    for each tokenizer form (``--tokenizer-dir``, else both cached test models)."""
    directories = [args.tokenizer_dir] if args.tokenizer_dir else _default_tokenizer_dirs()
    if not directories:
        print("no tokenizer: pass --tokenizer-dir (a model dir: tokenizer.json or Kimi's TikToken form)")
        return 2
    for directory in directories:
        _run_precise_dir(args, body, directory)
    return 0


def _run_precise_dir(args: argparse.Namespace, body: bytes, directory: str) -> None:
    from gateway.precise_tokens import ModelTokenizer, SessionHasher
    from prefix_index.base import ReplicaId
    from prefix_index.precise import EventBlockIndex

    tok = ModelTokenizer.from_dir(directory)
    data = orjson.loads(body)
    earlier = {**data, "messages": data["messages"][:-3]}
    replicas = [ReplicaId(f"http://r{i}:1") for i in range(8)]
    n = args.iterations
    for page in (int(p) for p in args.page_sizes.split(",")):
        segments = tok.prompt_segments("chat", data) or []
        hashes = SessionHasher(page).hash(segments, None).hashes
        index = EventBlockIndex()
        for i, r in enumerate(replicas):
            index.stored(r, hashes[: len(hashes) * (i + 1) // 8], "GPU")

        def request(hasher: SessionHasher, payload: dict[str, Any] = data, index: EventBlockIndex = index) -> None:
            prompt = hasher.hash(tok.prompt_segments("chat", payload) or [], "bench")
            index.match(prompt.hashes, replicas)

        def first(page: int = page) -> tuple[SessionHasher]:
            tok.clear_cache()
            return (SessionHasher(page),)

        def later(first: Callable[[], tuple[SessionHasher]] = first) -> tuple[SessionHasher]:
            (hasher,) = first()
            request(hasher, earlier)
            return (hasher,)

        tokens = sum(len(s.ids) for s in segments)
        print(f"precise, page {page}: {len(body):,} bytes, {tokens:,} tokens, {len(hashes):,} pages, "
              f"8 replicas; {n} samples each; {tok.form.kind} tokenizer {directory}")
        print(_line("first turn", *_measure_setup(first, request, n)))
        print(_line("later turn", *_measure_setup(later, request, n)))


def _measure_setup(setup: Callable[[], tuple[Any, ...]], fn: Callable[..., object], n: int
                   ) -> tuple[list[float], list[float]]:
    """Like ``_measure``, with an untimed ``setup`` before each timed ``fn(*setup())``."""
    wall, cpu = [], []
    for _ in range(n):
        state = setup()
        t, c = time.perf_counter(), time.process_time()
        fn(*state)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return sorted(wall), sorted(cpu)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_hashing", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
