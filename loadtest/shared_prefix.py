"""Shared prefixes without session ids: a seeded generator of production-API-like traffic.

The Claude Code sessions (`loadtest.synthetic`, ../shared/traces/claude-code) are one
user's agent re-sending its own growing history under a session header. Public API
traffic looks different (issue 45, item 1; the Mooncake conversation trace and Alibaba's
Bailian traces, ../shared/traces/README.md): many users of a few dozen *apps* send each
app's long system prompt and tool definitions, nobody sends a session id, and requests
arrive open loop. Reuse is across users (the app's prefix) and, within a short
conversation, across its turns (turn 2's prompt extends turn 1's) that carry no key
linking them. Neither trace exists on these machines, so this module builds workloads of
their shape.

Model (every default below; one seeded ``random.Random`` per half):

- **Apps**: ``apps`` (40) apps, popularity Zipf(``zipf_s`` = 1.0) over a random rank
  order. An app's prefix is ``prefix_min_tokens``..``prefix_max_tokens`` (1k-30k)
  tokens, log-uniform: a system prompt (30-70% of it) then tool definitions. An app has
  1-``max_variants`` (3) tool sets: its variants share the system prompt and differ in
  the tools, so prefixes form a two-level tree. A conversation picks an app by
  popularity and one of its variants uniformly; with ``no_app_share`` (20%) it has no
  app (a short system prompt of its own, shared with nobody).
- **Conversations**: ``1 + Geometric(continue_prob = 0.4)`` turns (mean 1.67, at most
  ``max_turns`` 8). Turn i's prompt = the prefix + every earlier user message and answer
  + its own user message, so it extends turn i-1's prompt: the same chained hash ids, then
  new ones. A user message is a chat message (lognormal, median 150 tokens) or, with
  ``doc_prob`` (25%), a pasted document (lognormal, median 12,000, capped at 100,000);
  the answer is lognormal (median 300, p90 1,200 tokens, at most 4,096). No headers:
  the gateway sees no session key on any turn.
- **Arrivals**: conversation starts are a Poisson process of ``conversation_rate``
  (2.0 per s) over ``duration_s`` (3,600 s): ~12,000 requests, the size of the hour in
  issue 45. A later turn arrives after the previous turn's answer (estimated at
  ``est_prefill_tokens_per_s`` and ``est_decode_s_per_token``) plus the user's think time
  (lognormal, median 30 s). Replay is open loop at these times (`Workload.open_loop`);
  `loadtest.traces.rate_scaled` compresses them (``kvgate simulate --rate-scale 4``).
- **Blocks**: ``block_size`` 512, as in the Mooncake traces (Kimi's format): chained
  hash ids of full blocks, the trailing partial block dropped (its tokens are unique to
  the request). Hash ids are sequential in one namespace per half.
- **Halves**: ``half="tuning"`` and ``half="validation"`` draw from independent streams
  (``random.Random(f"shared-prefix/{seed}/{half}")``): different apps (prefix lengths,
  popularity order), conversations and arrival times, in disjoint namespaces. Tune on one,
  report the other.

With the defaults (seed 0): ~12,000 requests per half (tuning 11,814, validation 12,235),
prompt tokens p50 5.7k / 8.4k, mean 12.1k / 13.9k, p99 ~80k (the Mooncake conversation
trace: mean 12k), output p50 ~300; an ideal (infinite cache, one server) hit rate of
58.2% / 63.4%, most of it the apps' prefixes.
"""
from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

from loadtest.synthetic import lognormal, p90_sigma
from loadtest.traces import HALVES, session_uuid
from loadtest.workload import Session, Turn, Workload, delta_encode

NAME = "synthetic-shared"


@dataclass(frozen=True)
class SharedPrefixParams:
    duration_s: float = 3_600.0
    conversation_rate: float = 2.0  # conversation starts per second (Poisson)
    block_size: int = 512
    apps: int = 40
    zipf_s: float = 1.0
    prefix_min_tokens: int = 1_000
    prefix_max_tokens: int = 30_000
    max_variants: int = 3  # tool sets per app, sharing its system prompt
    no_app_share: float = 0.2  # conversations with a system prompt of their own
    own_system_median: float = 200.0
    continue_prob: float = 0.4  # another turn follows
    max_turns: int = 8
    chat_median: float = 150.0
    chat_sigma: float = 1.0
    doc_prob: float = 0.25  # a user message is a pasted document
    doc_median: float = 12_000.0
    doc_sigma: float = 0.9
    max_user_tokens: int = 100_000
    output_median: float = 300.0
    output_p90: float = 1_200.0
    max_output_tokens: int = 4_096
    think_median_s: float = 30.0
    think_sigma: float = 1.0
    est_prefill_tokens_per_s: float = 40_000.0  # only to place a later turn after the answer
    est_decode_s_per_token: float = 0.02


@dataclass(frozen=True)
class _App:
    system: tuple[int, ...]  # hash ids of the system prompt's full blocks
    variants: tuple[tuple[int, ...], ...]  # each: system + that tool set's hash ids
    tokens: tuple[int, ...]  # each variant's prefix length in tokens


class SharedPrefixGenerator:
    def __init__(self, params: SharedPrefixParams, seed: int = 0, half: str = "tuning") -> None:
        if half not in HALVES:
            raise ValueError(f"half must be one of {', '.join(HALVES)}, not {half!r}")
        self.p, self.seed, self.half = params, seed, half
        self.rng = random.Random(f"shared-prefix/{seed}/{half}")
        self.namespace = f"{NAME}-{half}-{seed}"
        self._ids = itertools.count()
        self.apps = [self._app() for _ in range(params.apps)]
        order = list(range(params.apps))
        self.rng.shuffle(order)  # popularity rank is independent of prefix length
        weights = [0.0] * params.apps
        for rank, app in enumerate(order, start=1):
            weights[app] = rank ** -params.zipf_s
        self._cum = list(itertools.accumulate(weights))

    def _take(self, tokens: int) -> tuple[int, ...]:
        """Fresh hash ids for ``tokens`` tokens' full blocks."""
        return tuple(itertools.islice(self._ids, max(tokens, 0) // self.p.block_size))

    def _lognormal(self, median: float, sigma: float) -> float:
        return lognormal(self.rng, median, sigma)

    def _app(self) -> _App:
        p, rng, bs = self.p, self.rng, self.p.block_size
        lo, hi = math.log(p.prefix_min_tokens), math.log(p.prefix_max_tokens)
        total = round(math.exp(rng.uniform(lo, hi)))
        system_tokens = round(total * rng.uniform(0.3, 0.7)) // bs * bs
        system = self._take(system_tokens)
        n = rng.randint(1, max(1, p.max_variants))
        variants = tuple(system + self._take(total - system_tokens) for _ in range(n))
        return _App(system, variants, (total,) * n)

    def _prefix(self) -> tuple[tuple[int, ...], int]:
        """(hash ids, tokens) of a new conversation's system prompt and tools."""
        if self.rng.random() < self.p.no_app_share:
            tokens = round(self._lognormal(self.p.own_system_median, 1.0))
            return self._take(tokens), tokens
        x = self.rng.random() * self._cum[-1]
        app = self.apps[min(bisect.bisect_right(self._cum, x), len(self.apps) - 1)]
        v = self.rng.randrange(len(app.variants))
        return app.variants[v], app.tokens[v]

    def _user_tokens(self) -> int:
        p = self.p
        if self.rng.random() < p.doc_prob:
            return min(p.max_user_tokens, max(1, round(self._lognormal(p.doc_median, p.doc_sigma))))
        return min(p.max_user_tokens, max(1, round(self._lognormal(p.chat_median, p.chat_sigma))))

    def _output_tokens(self) -> int:
        p = self.p
        sigma = p90_sigma(p.output_median, p.output_p90)
        return min(p.max_output_tokens, max(1, round(self._lognormal(p.output_median, sigma))))

    def _turn_count(self) -> int:
        n = 1
        while n < self.p.max_turns and self.rng.random() < self.p.continue_prob:
            n += 1
        return n

    def _conversation(self, index: int, start_s: float) -> Session:
        p, bs = self.p, self.p.block_size
        prefix_ids, prefix_tokens = self._prefix()
        ids: list[int] = list(prefix_ids)
        tokens = prefix_tokens  # the conversation so far (prompt of the next turn, before its message)
        prev_ids: list[int] = []
        turns: list[Turn] = []
        at_s = start_s
        for _ in range(self._turn_count()):
            tokens += self._user_tokens()
            ids += self._take(tokens - len(ids) * bs)  # the full blocks the new message completes
            shared, new = delta_encode(prev_ids, ids)
            prev_ids = list(ids)
            out = self._output_tokens()
            turns.append(Turn(0.0, tokens, out, shared, new, at_s, kind="user"))
            answered_s = at_s + tokens / p.est_prefill_tokens_per_s + out * p.est_decode_s_per_token
            at_s = answered_s + self._lognormal(p.think_median_s, p.think_sigma)
            tokens += out
        sid = session_uuid(NAME, self.half, str(self.seed), str(index))
        return Session(sid, self.namespace, bs, tuple(turns))  # no headers: no session key

    def workload(self) -> Workload:
        sessions: list[Session] = []
        t = self.rng.expovariate(self.p.conversation_rate)
        while t < self.p.duration_s:
            sessions.append(self._conversation(len(sessions), t))
            t += self.rng.expovariate(self.p.conversation_rate)
        return Workload(NAME, tuple(sessions), open_loop=True)


def generate(params: SharedPrefixParams | None = None, seed: int = 0, half: str = "tuning") -> Workload:
    """One half of a seeded shared-prefix workload (same params, seed and half: the same
    workload; the two halves share nothing)."""
    return SharedPrefixGenerator(params or SharedPrefixParams(), seed, half).workload()
