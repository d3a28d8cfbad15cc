"""The routing framework: filters -> weighted scorers -> one picker, then hooks.

`Pipeline` is the one `Policy` implementation; every named policy (see
`policies.registry`) is a `Pipeline` assembled from plugins:

1. **Filters** narrow the candidate replicas (routable, scale-in, new sessions).
   No candidate left: `NoRoutableReplica`.
2. **Scorers** give each candidate a score in [0, 1]; the pipeline combines them as a
   weighted mean (weights come from the policy's params, not from the scorers).
3. **One picker** turns the combined scores into one replica (seeded rng for ties).
4. An **explainer** names the reason (bounded vocabulary, for metrics and the
   ``x-kvgate-route-reason`` header) and predicts the cached/uncached tokens.
5. **Hooks** (`policies.hooks`) carry every side effect, after the decision.

The framework times every plugin itself (cumulative seconds and call counts per plugin,
`Pipeline.timings()`), so plugins carry no instrumentation code: one clock reading after
each step, a plugin's time running from the previous step's reading (the framework's own
few operations between two plugins count to the second); a plugin that raises ends the
decision uncounted.

One path for every fleet size: the scorers give dicts, the pipeline combines them and the
picker picks, the same calls whether the fleet has one replica or 512 (`cache-aware`
evaluates its cost model once per candidate, in one pass: `policies.ttft_cost`).
"""

from __future__ import annotations

import operator
import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

from policies.base import (
    Decision,
    Filter,
    NoRoutableReplica,
    Outcome,
    Picker,
    PluginTiming,
    RequestContext,
    RoutingInputs,
    Scorer,
)
from policies.hooks import Hook, StandardHooks
from prefix_index.base import PrefixIndex, PrefixMatch, ReplicaId
from replicas.model import ReplicaView

_ID = operator.attrgetter("id")


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why the picked replica won, and how much of the prompt it should have cached."""

    reason: str
    cached_tokens: int
    uncached_tokens: int


class Explainer(Protocol):
    name: str

    def explain(
        self,
        ctx: RequestContext,
        inputs: RoutingInputs,
        candidates: Sequence[ReplicaView],
        chosen: ReplicaId,
    ) -> Explanation:
        """Pure: the reason and the predicted cached tokens of routing to ``chosen``."""
        ...


def matched_tokens(ctx: RequestContext, match: PrefixMatch) -> int:
    """Tokens of the prompt a prefix match covers (never more than the prompt)."""
    return min(match.blocks * ctx.block_tokens, ctx.est_prompt_tokens)


class PrefixExplainer:
    """Default: "only-one", "prefix" (the pick holds the longest match) or "balance"."""

    name = "prefix"

    def explain(
        self,
        ctx: RequestContext,
        inputs: RoutingInputs,
        candidates: Sequence[ReplicaView],
        chosen: ReplicaId,
    ) -> Explanation:
        best = max((inputs.matches.get(c.id, PrefixMatch()).blocks for c in candidates), default=0)
        mine = inputs.matches.get(chosen, PrefixMatch())
        cached = matched_tokens(ctx, mine)
        if len(candidates) == 1:
            reason = "only-one"
        elif mine.blocks > 0 and mine.blocks == best:
            reason = "prefix"
        else:
            reason = "balance"
        return Explanation(reason, cached, max(ctx.est_prompt_tokens - cached, 0))


class Timings:
    """Cumulative wall time per plugin, keyed "<kind>/<name>" (e.g. "scorer/ttft")."""

    def __init__(self) -> None:
        self._totals: dict[str, list[float]] = {}  # key -> [calls, seconds]

    def slot(self, key: str) -> list[float]:
        """``key``'s [calls, seconds] accumulator, which the pipeline adds to in place
        (no lookup or call per step); reported once it has a call."""
        return self._totals.setdefault(key, [0, 0.0])

    def add(self, key: str, seconds: float) -> None:
        total = self.slot(key)
        total[0] += 1
        total[1] += seconds

    def snapshot(self) -> dict[str, PluginTiming]:
        return {k: PluginTiming(int(calls), seconds) for k, (calls, seconds) in self._totals.items() if calls}


class Pipeline:
    """A policy composed of filters, weighted scorers, one picker, an explainer, hooks."""

    def __init__(
        self,
        name: str,
        *,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        explainer: Explainer | None = None,
        hooks: Sequence[Hook] | None = None,
        seed: int | None = None,
        resident_window_s: float = 600.0,
    ) -> None:
        if not scorers or any(w < 0 for _, w in scorers) or sum(w for _, w in scorers) <= 0:
            raise ValueError(
                f"policy {name!r}: needs scorers with non-negative weights summing > 0"
            )
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.explainer: Explainer = explainer or PrefixExplainer()
        self.hooks: tuple[Hook, ...] = tuple(hooks) if hooks is not None else (StandardHooks(),)
        self.seed = seed
        self.resident_window_s = (
            resident_window_s  # the window the gateway asks resident_tokens for
        )
        self._timings = Timings()
        # the plugins' accumulators, found once (a decision times five to seven calls)
        slot = self._timings.slot
        self._filter_steps = tuple((f, slot(f"filter/{f.name}")) for f in self.filters)
        self._scorer_steps = tuple((s, w, slot(f"scorer/{s.name}")) for s, w in self.scorers if w != 0)
        self._picker_slot = slot(f"picker/{picker.name}")
        self._explainer_slot = slot(f"explainer/{self.explainer.name}")
        self._total_weight = sum(w for _, w in self.scorers)

    def new_rng(self) -> random.Random:
        """An rng for `decide`, seeded from the policy's config (None: OS entropy).

        Create it once at start-up and pass the same one to every decision: a fresh
        seeded rng per request would repeat the same tie-breaks and herd.
        """
        return random.Random(self.seed)

    def timings(self) -> dict[str, PluginTiming]:
        """Cumulative time and calls per plugin, for metrics."""
        return self._timings.snapshot()

    def decide(self, ctx: RequestContext, inputs: RoutingInputs, rng: random.Random) -> Decision:
        # one clock reading after each step; a step's time runs from the previous reading
        clock = time.perf_counter
        candidates: list[ReplicaView] = list(inputs.replicas)
        t = clock()
        for f, acc in self._filter_steps:
            candidates = f.filter(ctx, inputs, candidates)
            now = clock()
            acc[0] += 1
            acc[1] += now - t
            t = now
        if not candidates:
            raise NoRoutableReplica(f"no routable replica among {len(inputs.replicas)}")
        scores, t = self._combined_scores(ctx, inputs, candidates, t)
        chosen = self.picker.pick(scores, rng)
        now = clock()
        acc = self._picker_slot
        acc[0] += 1
        acc[1] += now - t
        why = self.explainer.explain(ctx, inputs, candidates, chosen)
        acc = self._explainer_slot
        acc[0] += 1
        acc[1] += clock() - now
        return Decision(
            replica=chosen,
            reason=why.reason,
            policy=self.name,
            predicted_cached_tokens=why.cached_tokens,
            predicted_uncached_tokens=why.uncached_tokens,
            scores=scores,
        )

    def _combined_scores(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView], t: float
    ) -> tuple[dict[ReplicaId, float], float]:
        """The weighted mean of the scorers' scores; ``t``: the clock reading the first
        scorer's time starts from (returned: the last one taken)."""
        clock = time.perf_counter
        combined = dict.fromkeys(map(_ID, candidates), 0.0)  # a replica listed twice is scored once
        for scorer, weight, acc in self._scorer_steps:  # weight 0: not called
            part = scorer.score(ctx, inputs, candidates)
            now = clock()
            acc[0] += 1
            acc[1] += now - t
            t = now
            get = part.get
            for rid, c in combined.items():  # values replaced in place: the keys stay
                s = get(rid, 0.0)
                # ``weight * min(max(s, 0.0), 1.0)``, the builtins' very results (NaN
                # included), spelled as conditional expressions: no call per replica
                combined[rid] = c + weight * (0.0 if 0.0 > s else 1.0 if 1.0 < s else s)  # noqa: FURB136
        total_weight = self._total_weight
        for rid, c in combined.items():
            combined[rid] = c / total_weight
        return combined, t

    async def on_routed(
        self, ctx: RequestContext, decision: Decision, index: PrefixIndex, now_s: float
    ) -> None:
        for hook in self.hooks:
            await self._timed_hook(
                f"{hook.name}.on_routed", hook.on_routed(ctx, decision, index, now_s)
            )

    async def on_completed(
        self,
        ctx: RequestContext,
        decision: Decision,
        outcome: Outcome,
        index: PrefixIndex,
        now_s: float,
    ) -> None:
        for hook in self.hooks:
            call = hook.on_completed(ctx, decision, outcome, index, now_s)
            await self._timed_hook(f"{hook.name}.on_completed", call)

    async def _timed_hook(self, key: str, call: Awaitable[None]) -> None:
        start = time.perf_counter()
        try:
            await call
        finally:
            self._timings.add(f"hook/{key}", time.perf_counter() - start)

    def on_replica_added(self, replica: ReplicaId) -> None:
        for hook in self.hooks:
            hook.on_replica_added(replica)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        for hook in self.hooks:
            hook.on_replica_removed(replica)
