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

*Arrays.* When every scorer also has ``score_array`` (`ArrayScorer`: its scores as one
numpy array aligned with the candidates) and the picker has ``pick_index``
(`ArrayPicker`), steps 2 and 3 run over arrays for ``array_min_candidates`` (16) or more
candidates: the weighted mean is the same float operations per candidate, in the same
order, as the dict path, so the decision and its scores are the same, and a large fleet
costs a few numpy calls instead of Python per replica (`cache-aware` at 512 replicas:
docs/results-cost.md, section 2). Below that the numpy calls' fixed cost (~0.1 ms a
decision) exceeds what they save.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

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

ARRAY_MIN_CANDIDATES = 16  # the array path from this many candidates (the dict path is cheaper below)


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why the picked replica won, and how much of the prompt it should have cached."""

    reason: str
    cached_tokens: int
    uncached_tokens: int


class ArrayScorer(Scorer, Protocol):
    """A scorer that can also give its scores as an array aligned with ``candidates``."""

    def score_array(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> npt.NDArray[np.float64]:
        """The values `score` would give, in candidate order. Pure."""
        ...


class ArrayPicker(Picker, Protocol):
    """A picker that can also pick from an array of scores (candidate order)."""

    def pick_index(self, scores: npt.NDArray[np.float64], rng: random.Random) -> int:
        """The position `pick` would return for the same scores in that order."""
        ...


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
        self._totals: dict[str, list[float]] = {}  # key -> [calls, seconds]: one lookup a call

    def add(self, key: str, seconds: float) -> None:
        total = self._totals.get(key)
        if total is None:
            self._totals[key] = [1, seconds]
        else:
            total[0] += 1
            total[1] += seconds

    def snapshot(self) -> dict[str, PluginTiming]:
        return {k: PluginTiming(int(calls), seconds) for k, (calls, seconds) in self._totals.items()}

    def lap(self, key: str, start: float) -> float:
        """Adds the time since ``start`` (a ``perf_counter`` reading) to ``key``; returns
        the reading taken, the next step's start: one clock reading a step."""
        now = time.perf_counter()
        self.add(key, now - start)
        return now


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
        array_min_candidates: int = ARRAY_MIN_CANDIDATES,
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
        # the plugins' timing keys, formatted once (a decision times five to seven calls)
        self._filter_keys = tuple(f"filter/{f.name}" for f in self.filters)
        self._scorer_keys = tuple(f"scorer/{s.name}" for s, _ in self.scorers)
        self._picker_key = f"picker/{picker.name}"
        self._explainer_key = f"explainer/{self.explainer.name}"
        self._total_weight = sum(w for _, w in self.scorers)
        arrays = hasattr(picker, "pick_index") and all(hasattr(s, "score_array") for s, _ in self.scorers)
        self.array_min: int | None = array_min_candidates if arrays else None  # None: never arrays

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
        candidates: list[ReplicaView] = list(inputs.replicas)
        lap = self._timings.lap
        t = time.perf_counter()
        for f, key in zip(self.filters, self._filter_keys, strict=True):
            candidates = f.filter(ctx, inputs, candidates)
            t = lap(key, t)
        if not candidates:
            raise NoRoutableReplica(f"no routable replica among {len(inputs.replicas)}")
        ids = [c.id for c in candidates]
        if self.array_min is not None and len(ids) >= self.array_min and len(set(ids)) == len(ids):
            values, t = self._combined_array(ctx, inputs, candidates, t)
            picker: ArrayPicker = self.picker  # type: ignore[assignment]
            chosen = ids[picker.pick_index(values, rng)]
            t = lap(self._picker_key, t)
            scores = dict(zip(ids, values.tolist(), strict=True))
        else:
            scores, t = self._combined_scores(ctx, inputs, candidates, t)
            chosen = self.picker.pick(scores, rng)
            t = lap(self._picker_key, t)
        why = self.explainer.explain(ctx, inputs, candidates, chosen)
        lap(self._explainer_key, t)
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
        total_weight = self._total_weight
        lap = self._timings.lap
        combined = {c.id: 0.0 for c in candidates}
        for (scorer, weight), key in zip(self.scorers, self._scorer_keys, strict=True):
            if weight == 0:
                continue
            part = scorer.score(ctx, inputs, candidates)
            t = lap(key, t)
            for rid in combined:
                combined[rid] += weight * min(max(part.get(rid, 0.0), 0.0), 1.0)
        return {rid: s / total_weight for rid, s in combined.items()}, t

    def _combined_array(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView], t: float
    ) -> tuple[npt.NDArray[np.float64], float]:
        """`_combined_scores` over arrays: the same operations per candidate, same order."""
        total_weight = self._total_weight
        lap = self._timings.lap
        combined = np.zeros(len(candidates))
        for (scorer, weight), key in zip(self.scorers, self._scorer_keys, strict=True):
            if weight == 0:
                continue
            array_scorer: ArrayScorer = scorer  # type: ignore[assignment]
            part = array_scorer.score_array(ctx, inputs, candidates)
            t = lap(key, t)
            combined = combined + weight * np.minimum(np.maximum(part, 0.0), 1.0)
        out: npt.NDArray[np.float64] = combined / total_weight
        return out, t

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
