"""Hooks: the side effects of routing, run by the framework after the pure decision.

A hook reacts to four events: a request was routed (``on_routed``), it ended
(``on_completed``), a replica joined (``on_replica_added``) or left
(``on_replica_removed``). Filters, scorers and pickers never mutate anything; state a
policy needs (a round-robin counter, a hash ring, a radix tree, the prefix index and
the session table) changes only here.

`StandardHooks` is the behaviour every policy shares (the framework installs it by
default):

- ``on_routed``: predict-on-route. ``index.record(replica, ctx.block_hashes)`` (the
  replica will hold this chain once the request is prefilled) and, when the request has
  a session key, ``index.set_session(key, SessionEntry(replica, est_prompt_tokens +
  max_tokens, now))``.
- ``on_completed``: feedback. When the replica reported ``cached_tokens`` and the
  prediction exceeded it by more than ``max(2 blocks' tokens, 50% of the prediction)``,
  the index was wrong about that replica: ``index.truncate(replica, ctx.block_hashes,
  keep_blocks=cached_tokens // block_tokens)``. A small shortfall is normal (the last
  partial block, rounding of the 4-chars-per-token estimate) and is ignored. When the
  replica reported usage, the session's size becomes ``prompt_tokens +
  completion_tokens`` (the KV it will hold between turns), unless a later turn of the
  same session was meanwhile routed elsewhere.
"""

from __future__ import annotations

from typing import Protocol

from policies.base import Decision, Outcome, RequestContext
from prefix_index.base import PrefixIndex, ReplicaId, SessionEntry

FEEDBACK_MIN_BLOCKS = 2
FEEDBACK_MIN_FRACTION = 0.5


class Hook(Protocol):
    """Side effects after a decision, and reactions to fleet membership changes."""

    name: str

    async def on_routed(
        self, ctx: RequestContext, decision: Decision, index: PrefixIndex, now_s: float
    ) -> None: ...

    async def on_completed(
        self,
        ctx: RequestContext,
        decision: Decision,
        outcome: Outcome,
        index: PrefixIndex,
        now_s: float,
    ) -> None: ...

    def on_replica_added(self, replica: ReplicaId) -> None: ...

    def on_replica_removed(self, replica: ReplicaId) -> None: ...


class NoopHook:
    """A hook that does nothing; plugins with state subclass it and override what they need."""

    name = "noop"

    async def on_routed(
        self, ctx: RequestContext, decision: Decision, index: PrefixIndex, now_s: float
    ) -> None:
        return None

    async def on_completed(
        self,
        ctx: RequestContext,
        decision: Decision,
        outcome: Outcome,
        index: PrefixIndex,
        now_s: float,
    ) -> None:
        return None

    def on_replica_added(self, replica: ReplicaId) -> None:
        return None

    def on_replica_removed(self, replica: ReplicaId) -> None:
        return None


def feedback_keep_blocks(ctx: RequestContext, decision: Decision, outcome: Outcome) -> int | None:
    """How many blocks of the chain the replica really held, when the index over-predicted.

    None when there is nothing to correct (no report, or a shortfall within tolerance).
    """
    cached = outcome.cached_tokens
    if cached is None or ctx.block_tokens <= 0:
        return None
    predicted = decision.predicted_cached_tokens
    tolerance = max(FEEDBACK_MIN_BLOCKS * ctx.block_tokens, FEEDBACK_MIN_FRACTION * predicted)
    if predicted - cached <= tolerance:
        return None
    return max(cached, 0) // ctx.block_tokens


class StandardHooks(NoopHook):
    """Record the chain and the session on routing; correct the index on completion."""

    name = "standard"

    async def on_routed(
        self, ctx: RequestContext, decision: Decision, index: PrefixIndex, now_s: float
    ) -> None:
        if ctx.block_hashes:
            await index.record(decision.replica, ctx.block_hashes)
        key = ctx.session.session
        if key is not None:
            tokens = ctx.est_prompt_tokens + (ctx.max_tokens or 0)
            await index.set_session(key, SessionEntry(decision.replica, tokens, now_s))

    async def on_completed(
        self,
        ctx: RequestContext,
        decision: Decision,
        outcome: Outcome,
        index: PrefixIndex,
        now_s: float,
    ) -> None:
        keep = feedback_keep_blocks(ctx, decision, outcome)
        if keep is not None and keep < len(ctx.block_hashes):
            await index.truncate(decision.replica, ctx.block_hashes, keep_blocks=keep)
        key = ctx.session.session
        if key is None or not outcome.ok or outcome.prompt_tokens is None:
            return
        current = await index.get_session(key)
        if current is not None and current.replica != decision.replica:
            return  # a later turn already moved the session: keep that routing
        tokens = outcome.prompt_tokens + (outcome.completion_tokens or 0)
        await index.set_session(key, SessionEntry(decision.replica, tokens, now_s))
