"""Pickers: turn the combined scores into exactly one replica.

- `MaxScorePicker` ("max-score"): the highest score; every replica within
  ``tolerance`` (relative: ``score >= max / (1 + tolerance)``) of it is a tie, and ties
  are broken by the seeded rng (``random_ties=True``) or by input order, i.e. registry
  order (``random_ties=False``). Random tie-breaking is the defence against herding:
  decisions that see the same snapshot do not all pick the same replica.
- `SoftmaxPicker` ("softmax"): samples ``P(r) ~ exp((score_r - max) / temperature)``;
  a higher temperature spreads more (Dynamo's optional temperature).

Both are pure but for the rng they are given, and both iterate the scores in their
given order, so a seed reproduces a decision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from prefix_index.base import ReplicaId

_EPS = 1e-12


class MaxScorePicker:
    name = "max-score"

    def __init__(self, tolerance: float = 0.0, random_ties: bool = True) -> None:
        if tolerance < 0:
            raise ValueError("tolerance must be >= 0")
        self.tolerance = tolerance
        self.random_ties = random_ties

    def pick(self, scores: Mapping[ReplicaId, float], rng: random.Random) -> ReplicaId:
        if not scores:
            raise ValueError("nothing to pick from")
        best = max(scores.values())
        floor = best / (1.0 + self.tolerance) - _EPS
        ties = [rid for rid, s in scores.items() if s >= floor]
        if len(ties) == 1 or not self.random_ties:
            return ties[0]
        return ties[rng.randrange(len(ties))]


class SoftmaxPicker:
    name = "softmax"

    def __init__(self, temperature: float = 0.05) -> None:
        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        self.temperature = temperature

    def pick(self, scores: Mapping[ReplicaId, float], rng: random.Random) -> ReplicaId:
        if not scores:
            raise ValueError("nothing to pick from")
        ids = list(scores)
        best = max(scores.values())
        weights = [math.exp((scores[r] - best) / self.temperature) for r in ids]
        return rng.choices(ids, weights=weights, k=1)[0]
