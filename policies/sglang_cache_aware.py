"""`sglang-cache-aware`: SGLang router 0.3.2's ``cache_aware`` rule, reimplemented as a baseline.

The rule (docs: /work/shared/reference/peers.md), on ``ctx.routing_text`` (the chat
messages' text joined with spaces, as SGLang builds it):

1. Load = the gateway's own in-flight count per replica.
2. If ``max_load - min_load > balance_abs_threshold`` and ``max_load >
   balance_rel_threshold * min_load``: the least-loaded replica ("balance").
3. Else if ``matched_chars / input_chars > cache_threshold``: the replica that first
   created the deepest matched node of the approximate radix tree ("prefix").
4. Else the least in-flight replica, ties to the first in registry order ("balance").

The tree (`policies.radix`) learns only from this policy's own decisions, in the
``on_routed`` hook (never in ``decide``), never learns evictions, and is trimmed to
``max_tree_chars`` per replica (LRU leaves) every ``eviction_interval_s``. Its known
weakness is reproduced on purpose: once a shared system prompt exceeds the 0.3 match
rate, every session lands on the replica that saw it first (hot-spotting).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import Decision, RequestContext, RoutingInputs
from policies.baselines import single_scorer_policy
from policies.config import parse_params
from policies.framework import Explanation, Pipeline, PrefixExplainer
from policies.hooks import NoopHook
from policies.radix import ApproxRadixTree
from prefix_index.base import PrefixIndex, ReplicaId
from replicas.model import ReplicaView

NAME = "sglang-cache-aware"


@dataclass(frozen=True, slots=True)
class SglangParams:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_chars: int = 2**26


class SglangRule(NoopHook):
    """Scorer (one-hot on the rule's choice), explainer, and hook (tree upkeep) at once."""

    name = "sglang-rule"

    def __init__(self, params: SglangParams) -> None:
        self.params = params
        self.tree = ApproxRadixTree()
        self._last_trim_s: float | None = None
        self._memo: (
            tuple[tuple[str, tuple[tuple[ReplicaId, int], ...]], tuple[ReplicaId, str]] | None
        ) = None

    def choose(
        self, ctx: RequestContext, candidates: Sequence[ReplicaView]
    ) -> tuple[ReplicaId, str]:
        """The rule's pick and its reason (memoised for the explainer's second call)."""
        key = (ctx.request_id, tuple((c.id, c.in_flight) for c in candidates))
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        result = self._rule(ctx, candidates)
        self._memo = (key, result)
        return result

    def _rule(
        self, ctx: RequestContext, candidates: Sequence[ReplicaView]
    ) -> tuple[ReplicaId, str]:
        """Pure: reads the tree and the loads."""
        loads = [c.in_flight for c in candidates]
        least = candidates[loads.index(min(loads))].id
        high, low = max(loads), min(loads)
        p = self.params
        if high - low > p.balance_abs_threshold and high > p.balance_rel_threshold * low:
            return least, "balance"
        text = ctx.routing_text
        if text:
            matched, tenant = self.tree.match(text)
            ids = {c.id for c in candidates}
            if matched / len(text) > p.cache_threshold and tenant is not None and tenant in ids:
                return ReplicaId(tenant), "prefix"
        return least, "balance"

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        if not candidates:
            return {}
        chosen, _ = self.choose(ctx, candidates)
        return {c.id: 1.0 if c.id == chosen else 0.0 for c in candidates}

    def explain(
        self,
        ctx: RequestContext,
        inputs: RoutingInputs,
        candidates: Sequence[ReplicaView],
        chosen: ReplicaId,
    ) -> Explanation:
        base = PrefixExplainer().explain(ctx, inputs, candidates, chosen)
        rule_pick, reason = self.choose(ctx, candidates)
        if len(candidates) == 1:
            reason = "only-one"
        elif rule_pick != chosen:
            reason = "balance"
        return Explanation(reason, base.cached_tokens, base.uncached_tokens)

    async def on_routed(
        self, ctx: RequestContext, decision: Decision, index: PrefixIndex, now_s: float
    ) -> None:
        if ctx.routing_text:
            self.tree.insert(ctx.routing_text, decision.replica, now_s)
        if self._last_trim_s is None:
            self._last_trim_s = now_s
        elif now_s - self._last_trim_s >= self.params.eviction_interval_s:
            self.tree.evict(self.params.max_tree_chars)
            self._last_trim_s = now_s

    def on_replica_removed(self, replica: ReplicaId) -> None:
        self.tree.remove_tenant(replica)


def build(params: Mapping[str, Any] | None, seed: int | None) -> Pipeline:
    p = parse_params(SglangParams, params, NAME)
    rule = SglangRule(p)
    return single_scorer_policy(
        NAME, rule, params, seed, random_ties=False, state=rule, explainer=rule
    )
