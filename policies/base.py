"""The extension points of the routing framework, and the values they exchange."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefix_index.base import BlockHash, PrefixIndex, PrefixMatch, ReplicaId, SessionEntry
from replicas.model import ReplicaView


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """Session identity as the client sent it (headers coding agents send, or `user`).

    ``session`` is the conversation's key (for a subagent: its own agent id when sent,
    else its session). ``parent`` is the parent conversation's key for a subagent's first
    turn (Claude Code parent agent id, OpenCode parent session id).
    """

    session: str | None = None
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Everything a policy may know about a request, built once by the gateway."""

    request_id: str
    endpoint: str  # "chat" | "completions" | "generate" | "messages" | "count_tokens" | "responses"
    model: str
    session: SessionKeys
    block_hashes: tuple[BlockHash, ...]  # chained prefix hashes, bounded count
    prompt_chars: int
    est_prompt_tokens: int  # prompt_chars / chars_per_token
    block_tokens: int  # estimated tokens per block (block_chars / chars_per_token)
    max_tokens: int | None = None
    stream: bool = False
    routing_key: str | None = None  # stable text key for hash-based baselines (session or prefix)
    routing_text: str = ""  # SGLang-router style routing text (for the sglang-cache-aware baseline)
    # The parsed JSON body, kept for the gateway's own consumers (the precise index's
    # tokenizer, the Responses store); policies never read it.
    payload: Mapping[str, object] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class RoutingInputs:
    """A snapshot produced before scoring: replicas, their prefix matches, sessions."""

    replicas: tuple[ReplicaView, ...]
    matches: Mapping[ReplicaId, PrefixMatch]
    session: SessionEntry | None  # this session's last routing (None: new or unknown)
    parent_session: SessionEntry | None  # the parent's last routing (subagent first turn)
    resident_tokens: Mapping[ReplicaId, int]  # working set of live sessions per replica
    now_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    replica: ReplicaId
    reason: str  # bounded vocabulary, e.g. "affinity", "prefix", "balance", "new-session", "only-one"
    policy: str
    predicted_cached_tokens: int = 0
    predicted_uncached_tokens: int = 0
    scores: Mapping[ReplicaId, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a routed request, reported by the gateway to hooks."""

    ok: bool
    status: int
    prompt_tokens: int | None = None  # from usage, when the replica reported it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    completion_tokens: int | None = None
    ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class PluginTiming:
    """Cumulative calls and wall time of one plugin (the framework times every plugin)."""

    calls: int
    total_s: float


class Filter(Protocol):
    name: str

    def filter(self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Return the subset of candidates allowed (may return all). Pure."""
        ...


class Scorer(Protocol):
    name: str

    def score(self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]) -> dict[ReplicaId, float]:
        """A score in [0, 1] per candidate (higher is better). Pure."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, scores: Mapping[ReplicaId, float], rng: random.Random) -> ReplicaId:
        """Exactly one of the scored replicas. Pure but for the given rng."""
        ...


class Policy(Protocol):
    """A named routing policy. The gateway calls `decide` then the hooks, in order."""

    name: str
    resident_window_s: float  # how long a session between turns counts as resident

    def timings(self) -> Mapping[str, PluginTiming]:
        """Per plugin (e.g. ``scorer/ttft``): calls and total seconds, for metrics."""
        ...

    def decide(self, ctx: RequestContext, inputs: RoutingInputs, rng: random.Random) -> Decision:
        """Pure decision. Raises NoRoutableReplica when no candidate survives filtering."""
        ...

    async def on_routed(self, ctx: RequestContext, decision: Decision, index: PrefixIndex, now_s: float) -> None:
        """After the decision: record the chain in the index, update the session table."""
        ...

    async def on_completed(
        self, ctx: RequestContext, decision: Decision, outcome: Outcome, index: PrefixIndex, now_s: float
    ) -> None:
        """After the response ended: feedback (truncate on cache miss), session size."""
        ...

    def on_replica_added(self, replica: ReplicaId) -> None: ...

    def on_replica_removed(self, replica: ReplicaId) -> None: ...


class NoRoutableReplica(Exception):
    """No replica can take this request (all filtered out, draining, unhealthy)."""
