"""The gateway's router and the fleet simulation route through one core: same decisions.

One recorded-shape workload (growing sessions, new sessions sharing a system prompt,
completions with feedback) is routed twice, step by step: through ``gateway.router.Router``
(the gateway's async path, its index awaited) and through ``loadtest.fleetsim.router.SimRouter``
(virtual time, the index driven synchronously). Both get the same replica views at each
step and their own embedded index and policy instance, seeded alike: every decision
(replica, reason, predicted cached tokens) must be identical.
"""
from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import orjson

from gateway.context import ContextConfig, build_context
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from loadtest.fleetsim.router import SimRouter
from policies.base import Outcome, RequestContext
from policies.registry import make_policy
from prefix_index.base import ReplicaCapacity, ReplicaId
from prefix_index.config import IndexConfig
from prefix_index.factory import make_index
from replicas.probe import Capacity

IDS = [ReplicaId(f"http://127.0.0.1:{31001 + i}") for i in range(3)]
SPEC = Capacity(device_tokens=200_000, host_tokens=400_000, page_size=64, max_running_requests=32)
SYSTEM = "You are a careful coding agent. " * 200


def stats(_: int) -> Any:
    return SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0, num_waiting_uncached_tokens=0,
                           token_usage=0.0, max_running_requests=32, spec_accept_length_avg=0.0)


def workload(seed: int) -> list[tuple[float, RequestContext]]:
    rng = random.Random(seed)
    cfg = ContextConfig()
    history: dict[str, list[dict[str, str]]] = {}
    out: list[tuple[float, RequestContext]] = []
    t = 0.0
    for step in range(120):
        t += rng.choice([0.05, 0.2, 0.7, 1.5])
        session = f"s{rng.randrange(14)}"
        msgs = history.setdefault(session, [{"role": "system", "content": SYSTEM}])
        msgs.append({"role": "user", "content": f"turn {step} of {session}: " + "x" * rng.randrange(100, 4000)})
        body = orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 64})
        out.append((t, build_context("chat", body, {"x-kvgate-session": session}, "application/json", cfg)))
        msgs.append({"role": "assistant", "content": "ok " * rng.randrange(5, 50)})
    return out


async def test_gateway_router_and_fleetsim_decide_alike() -> None:
    seed = 7
    sim_policy = make_policy("cache-aware", {}, seed)
    sim_index = make_index(IndexConfig())
    sim = SimRouter(sim_policy, sim_index, list(IDS), [SPEC] * len(IDS), stats, block_tokens=64, seed=seed)

    gw_policy = make_policy("cache-aware", {}, seed)
    gw_index = make_index(IndexConfig())
    clock = [0.0]
    current: dict[str, Any] = {}
    router = Router(gw_policy, gw_index, lambda: current["views"], GatewayMetrics(), rng=random.Random(seed),
                    clock=lambda: clock[0])
    for rid in IDS:
        gw_policy.on_replica_added(rid)
        await gw_index.set_capacity(rid, ReplicaCapacity(SPEC.device_tokens // 64, SPEC.host_tokens // 64))

    pending: list[tuple[float, RequestContext, Any, Any, Any]] = []
    decisions = 0
    seen: set[tuple[str, str]] = set()
    for t, ctx in workload(seed):
        for done in [p for p in pending if p[0] <= t]:  # completions due before this request
            pending.remove(done)
            _, dctx, d_gw, d_sim, lease = done
            outcome = Outcome(ok=True, status=200, prompt_tokens=dctx.est_prompt_tokens,
                              cached_tokens=d_sim.predicted_cached_tokens, completion_tokens=64)
            clock[0] = done[0]
            await router.completed(dctx, d_gw, outcome)
            sim.completed(dctx, d_sim, outcome, done[0])
            lease.release()
        clock[0] = t
        current["views"] = sim.views(t)
        inputs = await router.snapshot(ctx)
        d_gw = router.decide(ctx, inputs)
        await router.routed(ctx, d_gw)
        routed = sim.route(ctx, t)
        assert routed is not None
        d_sim, lease = routed
        assert (d_gw.replica, d_gw.reason, d_gw.predicted_cached_tokens) == (
            d_sim.replica, d_sim.reason, d_sim.predicted_cached_tokens), f"request {decisions} at t={t}"
        decisions += 1
        seen.add((d_gw.replica, d_gw.reason))
        pending.append((t + 0.9, ctx, d_gw, d_sim, lease))
    assert decisions == 120
    assert len({r for r, _ in seen}) == len(IDS) and {"affinity", "prefix"} <= {why for _, why in seen}, seen
