"""Synthetic agentic coding sessions, parameterised from published production figures.

Sources of the defaults:

- ../shared/traces/README.md, measured on the public Claude Code traces
  (callanjfox/kv-cache-tester, 710 sessions, 49,334 requests): input tokens p50 103,662 /
  p90 233,633; output tokens p50 216 / p90 898; requests per session p50 46 / p90 157;
  ideal prefix hit rate 96.3%, practically all within a session; every turn's input is
  the whole history so far plus something new.
- The trace files themselves (e.g. trace_0004): tool prompt ~12.4k tokens and system
  prompt ~3k tokens shared by the main agent; subagents ("Explore") with their own ~7.8k
  + ~1k prompts, ~5-25 requests each; think times of a few seconds between tool calls,
  user pauses of tens of seconds to hours; compaction (a turn whose prompt keeps only the
  system prompt of the previous one: trace_0010 turn 14 drops from 148k to 62k tokens).

Model: a session has ``turns ~ lognormal(median 46, p90 157)``. Its history starts at
``lognormal(initial_median)`` tokens and grows every turn by the previous output plus a
new tool result (``lognormal(tool_output_median)``) or user message. Think time before a
turn is a lognormal mixture: tool calls (tens of ms to seconds, a tail of minutes) or the
user (seconds to minutes). When system + history exceeds ``compact_at_tokens`` the next
turn is a compaction: the history is replaced by a summary (new hash ids from the end of
the system prompt on). With probability ``subagent_prob`` a turn launches 1-3 subagents.
All draws come from one seeded ``random.Random``; hash ids are allocated sequentially in
one namespace, and the system prompts' ids are shared by every session.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from loadtest.traces import session_uuid
from loadtest.workload import Session, Turn, Workload, delta_encode

Z90 = 1.2816  # standard normal 90th percentile


@dataclass(frozen=True)
class SyntheticParams:
    sessions: int = 64
    block_size: int = 64
    tool_tokens: int = 12_400  # shared tool schemas (trace_0004: 12,439)
    system_tokens: int = 3_000  # shared system prompt (trace_0004: 2,979)
    turns_median: float = 46.0  # requests per session p50 46 / p90 157
    turns_p90: float = 157.0
    max_turns: int = 600
    initial_median: float = 40_000.0  # first prompt + project context (tuned: input p50 ~100k)
    initial_sigma: float = 0.8
    tool_output_median: float = 1_300.0  # new tokens per tool result (tuned: input p90 ~245k)
    tool_output_sigma: float = 1.3
    user_message_median: float = 150.0
    user_prob: float = 0.1  # a turn follows a user message (else a tool result)
    output_median: float = 216.0  # output p50 216 / p90 898
    output_p90: float = 898.0
    tool_think_fast: tuple[float, float] = (0.8, 1.2)  # (median s, sigma): tens of ms .. s
    tool_think_slow: tuple[float, float] = (45.0, 1.0)  # slow tools: the tail of minutes
    tool_slow_prob: float = 0.05
    user_think: tuple[float, float] = (20.0, 1.2)  # seconds to minutes
    compact_at_tokens: int = 300_000
    compacted_median: float = 25_000.0
    subagent_prob: float = 0.02
    sub_tool_tokens: int = 7_800
    sub_system_tokens: int = 1_000
    sub_turns_median: float = 10.0
    sub_initial_median: float = 6_000.0

    def scaled(self, factor: float) -> SyntheticParams:
        """The same shape with every token size multiplied by ``factor`` (e.g. for small
        test profiles); turn counts, think times and probabilities are unchanged."""
        sizes = ("tool_tokens", "system_tokens", "initial_median", "tool_output_median",
                 "user_message_median", "output_median", "output_p90", "compact_at_tokens",
                 "compacted_median", "sub_tool_tokens", "sub_system_tokens", "sub_initial_median")
        changes = {k: type(getattr(self, k))(max(1, getattr(self, k) * factor)) for k in sizes}
        return dataclasses.replace(self, **changes)


class _Ids:
    """Sequential hash id allocator (one namespace for the whole workload)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    """A lognormal draw of this median and log-space sigma."""
    return rng.lognormvariate(math.log(median), sigma)


def p90_sigma(median: float, p90: float) -> float:
    """The log-space sigma of a lognormal with this median and 90th percentile."""
    return math.log(p90 / median) / Z90


class SyntheticGenerator:
    def __init__(self, params: SyntheticParams, seed: int = 0) -> None:
        self.p = params
        self.seed = seed
        self.rng = random.Random(seed)
        self.ids = _Ids()
        bs = params.block_size
        self.main_system = self.ids.take((params.tool_tokens + params.system_tokens) // bs)
        self.sub_system = self.ids.take((params.sub_tool_tokens + params.sub_system_tokens) // bs)
        self.namespace = f"synthetic-{seed}"

    def workload(self) -> Workload:
        sessions = []
        for i in range(self.p.sessions):
            sid = session_uuid("synthetic", str(self.seed), str(i))
            turns_sigma = p90_sigma(self.p.turns_median, self.p.turns_p90)
            n = min(self.p.max_turns, max(1, round(lognormal(self.rng, self.p.turns_median, turns_sigma))))
            sessions.append(self._session(sid, {"x-claude-code-session-id": sid}, None, n,
                                          self.main_system, self.p.initial_median, 0.0))
        return Workload("synthetic", tuple(sessions))

    def _think(self, kind: str) -> float:
        p = self.p
        if kind == "user":
            return lognormal(self.rng, *p.user_think)
        median, sigma = p.tool_think_slow if self.rng.random() < p.tool_slow_prob else p.tool_think_fast
        return lognormal(self.rng, median, sigma)

    def _output(self) -> int:
        sigma = p90_sigma(self.p.output_median, self.p.output_p90)
        return max(1, min(8192, round(lognormal(self.rng, self.p.output_median, sigma))))

    def _session(self, sid: str, headers: dict[str, str], parent: str | None, n_turns: int,
                 system: list[int], initial_median: float, delay_s: float) -> Session:
        p, rng, bs = self.p, self.rng, self.p.block_size
        system_tokens = len(system) * bs
        history = round(lognormal(rng, initial_median, p.initial_sigma))
        hist_ids = self.ids.take(history // bs)
        prev_ids: list[int] = []
        turns: list[Turn] = []
        kind, think = "user", 0.0
        for t in range(n_turns):
            ids = system + hist_ids
            shared, new = delta_encode(prev_ids, ids)
            prev_ids = ids
            out = self._output()
            subs = self._subagents(headers, sid) if parent is None and t > 0 else ()
            turns.append(Turn(think, system_tokens + history, out, shared, new, subagents=subs, kind=kind))
            kind = "user" if rng.random() < p.user_prob else "tool"
            think = self._think(kind)
            if system_tokens + history > p.compact_at_tokens:
                kind, history = "compaction", round(lognormal(rng, p.compacted_median, 0.5))
                hist_ids = self.ids.take(history // bs)
                continue
            median = p.user_message_median if kind == "user" else p.tool_output_median
            history += out + round(lognormal(rng, median, p.tool_output_sigma))
            hist_ids += self.ids.take(history // bs - len(hist_ids))
        return Session(sid, self.namespace, bs, tuple(turns), len(system), headers, parent, delay_s)

    def _subagents(self, headers: dict[str, str], sid: str) -> tuple[Session, ...]:
        if self.rng.random() >= self.p.subagent_prob:
            return ()
        subs = []
        for _ in range(self.rng.randint(1, 3)):
            agent = session_uuid(sid, "agent", str(self.ids.next))
            sub_headers = {"x-claude-code-session-id": headers["x-claude-code-session-id"],
                           "x-claude-code-agent-id": agent, "x-claude-code-parent-agent-id": sid}
            n = max(1, round(lognormal(self.rng, self.p.sub_turns_median, 0.6)))
            subs.append(self._session(agent, sub_headers, sid, n, self.sub_system,
                                      self.p.sub_initial_median, self.rng.uniform(0.0, 1.0)))
        return tuple(subs)


def generate(params: SyntheticParams | None = None, seed: int = 0) -> Workload:
    """A seeded synthetic workload (same params and seed: the same workload)."""
    return SyntheticGenerator(params or SyntheticParams(), seed).workload()
