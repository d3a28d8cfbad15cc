"""`cache-aware` decides as it did when its cost model had three implementations (issue 40).

`tests/policies/data/golden_decisions.json` holds 380 decisions of the policy before the
scalar, array and one-pass forms became one (`ttft_cost.candidate_costs` under the plugin
pipeline), over seeded random fleets of 1, 3, 8, 64 and 512 replicas: varied loads and
states, matches (some stated by KV events, a lost home), sessions, parents, held
requests, params and weights. Each case stores the chosen replica, reason, predicted
tokens, a digest of every score's exact bits and of the rng's next draw (the same rng
use). A change to the model changes these on purpose: regenerate with
``python -m tests.policies.test_golden_decisions --write`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from policies.base import NoRoutableReplica, RequestContext, RoutingInputs
from policies.registry import make_policy
from policies.routing import ExactMatch
from prefix_index.base import PrefixMatch, SessionEntry
from replicas.model import ReplicaState
from tests.policies.support import ctx, rid, view

GOLDEN = Path(__file__).parent / "data" / "golden_decisions.json"
COUNTS = {1: 60, 3: 120, 8: 120, 64: 60, 512: 20}
PARAMS: list[dict[str, Any]] = [
    {}, {"spread_weight": 0.0}, {"spread_weight": 3.0},
    {"tie_tolerance": 0.0, "move_margin_s": 0.0}, {"parent_prefix_fraction": 1.0, "abandon_weight": 0.0},
    {"prefill_chunk_tokens": 0}, {"tie_tolerance_s": 0.0}, {"lost_home_fraction": 0.9},
]
WEIGHTS: list[dict[str, float] | None] = [None, None, None, {"new-session": 0.0}, {"ttft": 0.0},
                                          {"new-session": 2.0}]


def _scenario(r: random.Random, n: int) -> tuple[RequestContext, RoutingInputs]:
    alike = r.random() < 0.3  # equal views: many ties, the rng decides
    base = {"device_tokens": r.randrange(1_000_001), "host_tokens": r.choice([0, r.randrange(1_000_001)]),
            "max_running_requests": r.randrange(65)}
    views = []
    for i in range(n):
        if alike:
            kw: dict[str, Any] = {**base, "in_flight": r.choice([0, 1])}
            state = ReplicaState.ACTIVE if r.random() < 0.95 else r.choice(list(ReplicaState))
        else:
            kw = {"device_tokens": r.randrange(1_000_001), "host_tokens": r.choice([0, r.randrange(1_000_001)]),
                  "max_running_requests": r.randrange(65), "in_flight": r.randrange(201),
                  "pending_prefill_tokens": r.randrange(2_000_001), "decoding": r.randrange(101),
                  "reported_running": r.randrange(101), "reported_waiting": r.randrange(101),
                  "reported_waiting_uncached_tokens": r.randrange(2_000_001)}
            state = r.choice(list(ReplicaState)) if r.random() < 0.3 else ReplicaState.ACTIVE
        held = tuple(r.randrange(300_001) for _ in range(r.randrange(4))) if r.random() < 0.2 else ()
        kw["pending_prefill_tokens"] = kw.get("pending_prefill_tokens", 0) + sum(held)
        views.append(view(i, state=state, held_prefill=held, added_at_s=r.uniform(0, 10_000),
                          removal_candidate=r.random() < 0.1, **kw))
    prompt = r.choice([0, r.randrange(200_001), r.randrange(20_000)])
    blocks = prompt // 64
    shared = r.randrange(blocks + 1)
    exact = r.random() < 0.3
    matches: dict[Any, PrefixMatch] = {}
    for v in views:
        kind = r.choice(["none", "none", "shared", "random"])
        dev = {"none": 0, "shared": shared, "random": r.randrange(blocks + 1)}[kind]
        host = r.randrange(blocks - dev + 1) if kind == "random" else 0
        matches[v.id] = (ExactMatch if exact and r.random() < 0.7 else PrefixMatch)(dev, host)

    def entry() -> SessionEntry:
        return SessionEntry(rid(r.randrange(n + 1)), r.randrange(300_001), r.uniform(0, 10_000))

    c = ctx(prompt, session=r.choice([None, "s"]), parent=r.choice([None, "p"]),
            max_tokens=r.choice([None, 0, 256, 4096]))
    resident = {v.id: r.randrange(3_000_001) for v in views if r.random() < 0.5}
    return c, RoutingInputs(replicas=tuple(views), matches=matches, session=entry() if r.random() < 0.5 else None,
                            parent_session=entry() if r.random() < 0.4 else None, resident_tokens=resident,
                            now_s=10_000.0)


def decisions() -> list[list[Any]]:
    """[replicas, chosen index (-1: none routable), reason, cached, uncached, digest] per case."""
    r = random.Random(20261206)
    out: list[list[Any]] = []
    for n, count in COUNTS.items():
        for _ in range(count):
            c, inputs = _scenario(r, n)
            params: dict[str, Any] = {**r.choice(PARAMS), "weights": r.choice(WEIGHTS)}
            seed = r.randrange(2**32)
            rng = random.Random(seed)
            try:
                d = make_policy("cache-aware", params, seed).decide(c, inputs, rng)
            except NoRoutableReplica:
                out.append([n, -1, "", 0, 0, rng.random().hex()])
                continue
            exact = ";".join(f"{k}={v.hex()}" for k, v in d.scores.items()) + f";rng={rng.random().hex()}"
            chosen = [v.id for v in inputs.replicas].index(d.replica)
            out.append([n, chosen, d.reason, d.predicted_cached_tokens, d.predicted_uncached_tokens,
                        hashlib.sha256(exact.encode()).hexdigest()[:16]])
    return out


def test_decisions_equal_the_recorded_ones() -> None:
    want = json.loads(GOLDEN.read_text())
    got = decisions()
    assert len(got) == len(want)
    differ = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    assert not differ, f"{len(differ)} decisions changed, the first: {differ[:3]}"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.write_text("[\n" + ",\n".join(json.dumps(d) for d in decisions()) + "\n]\n")
