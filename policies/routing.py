"""The one routing core, synchronous: inputs -> decide -> account.

The gateway (``gateway/router.py``, over the network and an async index) and the fleet
simulation (``loadtest/fleetsim/router.py``, in virtual time) both route through this
class, so ``kvgate simulate`` runs exactly the code the gateway runs. What differs
between them stays outside: how the index reads are awaited, where replica views come
from, what happens on failure.

Per request the caller gathers the index's answers (prefix matches, the session's and
its parent's entries) and, when ``resident_fresh(now)`` is None, the fleet's resident
working set (``store_resident``); then:

1. ``inputs(...)`` assembles the frozen ``RoutingInputs`` (every replica gets a match,
   empty when the index knows none), with the resident set as last patched;
2. ``decide(ctx, inputs, exclude)`` runs the pure policy over the replicas not excluded
   (retries: the tried ones), raising ``NoRoutableReplica``;
3. ``account(ctx, decision)``, right after the decision and before anything yields,
   adds the session to its replica's resident set, so the next decision sees it even
   before the cached set is refreshed (a burst of new sessions must see each other).

The resident set is a sum over live sessions that changes slowly: it is re-read at most
every ``resident_cache_s`` (1 s) and patched by ``account`` in between.

Precise mode (issue 13): replicas that publish KV events are matched exactly, in tokens,
from ``prefix_index.precise.EventBlockIndex`` (``to_prefix_match(..., block_tokens=1)``);
the others keep the approximate index's block matches. ``merge_matches`` puts both in
one unit (tokens) and ``token_context`` gives the policy a context in that unit (block
of 1 token, the exact prompt length), so the policy's ``predicted_cached_tokens`` is
exact for precise replicas and unchanged for approximate ones. The gateway's router and
the fleet simulation both call these two before ``inputs``/``decide``.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

from policies.base import Decision, Policy, RequestContext, RoutingInputs
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from replicas.model import ReplicaView

NO_MATCH = PrefixMatch()
RESIDENT_CACHE_S = 1.0


def merge_matches(approx: Mapping[ReplicaId, PrefixMatch], precise: Mapping[ReplicaId, PrefixMatch], *,
                  approx_block_tokens: int = 1) -> dict[ReplicaId, PrefixMatch]:
    """One match per replica: ``precise``'s where it has one, else ``approx``'s.

    ``approx`` counts blocks of ``approx_block_tokens`` tokens (the request's
    ``ctx.block_tokens``); they are scaled to the unit of ``precise`` (tokens, when it
    comes from ``to_prefix_match(..., block_tokens=1)``). A replica in ``precise`` is
    answered by it even when it matched nothing (the events say it holds nothing):
    callers leave uncertain replicas out of ``precise`` so they fall back to ``approx``.
    Pure.
    """
    scale = max(approx_block_tokens, 1)
    out = {r: PrefixMatch(m.device_blocks * scale, m.host_blocks * scale) for r, m in approx.items()}
    out.update(precise)
    return out


def token_context(ctx: RequestContext, prompt_tokens: int) -> RequestContext:
    """``ctx`` in token units, for deciding over ``merge_matches`` output: a block is one
    token and the prompt is its exact token count. Pure; the original ``ctx`` (with its
    approximate block chain) stays the one given to the hooks."""
    return dataclasses.replace(ctx, block_tokens=1, est_prompt_tokens=max(prompt_tokens, 0))


class RoutingCore:
    def __init__(self, policy: Policy, rng: random.Random, *, resident_cache_s: float = RESIDENT_CACHE_S) -> None:
        self.policy = policy
        self.rng = rng
        self.resident_window_s = policy.resident_window_s  # sessions seen within it are resident
        self.resident_cache_s = resident_cache_s
        self._resident: tuple[float, Mapping[ReplicaId, int]] | None = None

    # ---------------------------------------------------------------- resident set
    def resident_fresh(self, now_s: float) -> Mapping[ReplicaId, int] | None:
        """The cached resident set while it is fresh, else None (the caller re-reads it)."""
        if self._resident is not None and now_s - self._resident[0] < self.resident_cache_s:
            return self._resident[1]
        return None

    def store_resident(self, now_s: float, resident: Mapping[ReplicaId, int]) -> None:
        self._resident = (now_s, resident)

    def resident(self) -> Mapping[ReplicaId, int]:
        return self._resident[1] if self._resident is not None else {}

    # ---------------------------------------------------------------- one request
    def inputs(self, ctx: RequestContext, replicas: Sequence[ReplicaView],
               matches: Mapping[ReplicaId, PrefixMatch], session: SessionEntry | None,
               parent: SessionEntry | None, now_s: float) -> RoutingInputs:
        views = tuple(replicas)
        return RoutingInputs(
            replicas=views,
            matches={v.id: matches.get(v.id, NO_MATCH) for v in views},
            session=session, parent_session=parent, resident_tokens=self.resident(), now_s=now_s,
        )

    def decide(self, ctx: RequestContext, inputs: RoutingInputs,
               exclude: frozenset[ReplicaId] = frozenset()) -> Decision:
        """The policy's choice among the replicas not in ``exclude``; raises NoRoutableReplica."""
        if exclude:
            inputs = dataclasses.replace(inputs, replicas=tuple(v for v in inputs.replicas if v.id not in exclude))
        return self.policy.decide(ctx, inputs, self.rng)

    def account(self, ctx: RequestContext, decision: Decision) -> None:
        """The session just routed is resident on its replica from now on."""
        if self._resident is None or ctx.session.session is None:
            return
        taken_s, resident = self._resident
        updated = dict(resident)
        updated[decision.replica] = updated.get(decision.replica, 0) + ctx.est_prompt_tokens + (ctx.max_tokens or 0)
        self._resident = (taken_s, updated)
