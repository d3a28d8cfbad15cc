"""The one routing core, synchronous: inputs -> decide -> account.

The gateway (``gateway/router.py``, over the network and an async index) and the fleet
simulation (``loadtest/fleetsim/router.py``, in virtual time) both route through this
class, so ``kvgate simulate`` runs exactly the code the gateway runs. What differs
between them stays outside: how the index reads are awaited, where replica views come
from, what happens on failure.

Per request the caller gathers the index's answers (prefix matches, the session's and
its parent's entries) and, when ``resident_fresh(now)`` is None, the fleet's resident
working set (``store_resident``); then:

1. ``inputs(...)`` assembles the frozen ``RoutingInputs`` over the replicas serving the
   request's model (``serving``: the one model filter; every replica when none reports
   its models), each with a match (empty when the index knows none), with the resident
   set as last patched;
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
the fleet simulation both call these two before ``inputs``/``decide``. ``merge_matches``
marks the precise replicas' matches as `ExactMatch` (equal to a ``PrefixMatch`` of the same
counts), so the policy can tell a match the replica's events stated from a prediction
(`policies.ttft_cost`: a home replica that exactly holds little of the session).

Events only state what a replica has *stored*: a request routed a moment ago whose
prefill has not run yet is invisible to them (approximate mode sees it at once: it
records the chain on route). ``RoutingCore`` therefore remembers the chains it routed in
the last ``IN_FLIGHT_S`` (`InFlightChains`) and, for a request without a session entry
(a new session, a subagent's first turn, a one-shot request: the ones that share a
prefix with other requests), raises an exact match to the part of the prompt a request
just routed there shares with it (the raised match is a plain ``PrefixMatch``: partly
predicted). A session's later turns are left to the events alone.
"""
from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.base import Decision, Policy, RequestContext, RoutingInputs
from prefix_index.base import BlockHash, PrefixMatch, ReplicaId, SessionEntry, common_chain_prefix
from replicas.model import ReplicaView

NO_MATCH = PrefixMatch()
ANY_MODEL = "default"  # the model of a request that names none (gateway.context): any replica serves it
RESIDENT_CACHE_S = 1.0
IN_FLIGHT_S = 15.0  # a routed prompt is in its replica's events once prefilled (p99 TTFT ~8-14 s)
IN_FLIGHT_MAX = 1024  # chains remembered at most (each is the request's own hash tuple, ~58 KB at 400 KB)


@dataclass(frozen=True, slots=True, eq=False)
class ExactMatch(PrefixMatch):
    """A match stated by the replica's KV events (precise mode), not predicted.

    Compares and hashes as the ``PrefixMatch`` of the same counts, so callers that only
    read the counts see no difference; policies may test ``isinstance(m, ExactMatch)``.
    """

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PrefixMatch):
            return (self.device_blocks, self.host_blocks) == (other.device_blocks, other.host_blocks)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.device_blocks, self.host_blocks))


def is_exact(match: PrefixMatch | None) -> bool:
    """True when ``match`` was stated by KV events (`ExactMatch`)."""
    return isinstance(match, ExactMatch)


def merge_matches(approx: Mapping[ReplicaId, PrefixMatch], precise: Mapping[ReplicaId, PrefixMatch], *,
                  approx_block_tokens: int = 1) -> dict[ReplicaId, PrefixMatch]:
    """One match per replica: ``precise``'s where it has one, else ``approx``'s.

    ``approx`` counts blocks of ``approx_block_tokens`` tokens (the request's
    ``ctx.block_tokens``); they are scaled to the unit of ``precise`` (tokens, when it
    comes from ``to_prefix_match(..., block_tokens=1)``). A replica in ``precise`` is
    answered by it even when it matched nothing (the events say it holds nothing):
    callers leave uncertain replicas out of ``precise`` so they fall back to ``approx``.
    The precise ones come back as `ExactMatch`. Pure.
    """
    scale = max(approx_block_tokens, 1)
    out = {r: PrefixMatch(m.device_blocks * scale, m.host_blocks * scale) for r, m in approx.items()}
    out.update({r: m if isinstance(m, ExactMatch) else ExactMatch(m.device_blocks, m.host_blocks)
                for r, m in precise.items()})
    return out


def token_context(ctx: RequestContext, prompt_tokens: int) -> RequestContext:
    """``ctx`` in token units, for deciding over ``merge_matches`` output: a block is one
    token and the prompt is its exact token count. Pure; the original ``ctx`` (with its
    approximate block chain) stays the one given to the hooks."""
    return dataclasses.replace(ctx, block_tokens=1, est_prompt_tokens=max(prompt_tokens, 0))


def serving(views: tuple[ReplicaView, ...], model: str) -> tuple[ReplicaView, ...]:
    """The replicas a request for ``model`` may go to: those whose ``models`` include it.

    Every replica when the request names no model (``ANY_MODEL``) or when no replica
    reports its models (a fleet of one model, as before model-aware routing). Otherwise a
    replica whose models are not known yet (its probe is pending) serves none. Pure."""
    if model == ANY_MODEL or not any(v.models for v in views):
        return views
    return tuple(v for v in views if model in v.models)


class InFlightChains:
    """The chains routed in the last ``window_s``, to cover what KV events cannot state yet."""

    def __init__(self, window_s: float = IN_FLIGHT_S, max_chains: int = IN_FLIGHT_MAX) -> None:
        self.window_s = window_s
        self._recent: deque[tuple[float, ReplicaId, tuple[BlockHash, ...]]] = deque(maxlen=max_chains)

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, now_s: float, replica: ReplicaId, chain: tuple[BlockHash, ...]) -> None:
        if chain:
            self._recent.append((now_s, replica, chain))

    def overlay(self, now_s: float, ctx: RequestContext,
                matches: Mapping[ReplicaId, PrefixMatch]) -> Mapping[ReplicaId, PrefixMatch]:
        """``matches`` with each exact one raised to the tokens an in-flight chain shares."""
        recent = self._recent
        while recent and now_s - recent[0][0] > self.window_s:
            recent.popleft()
        if not recent or not ctx.block_hashes:
            return matches
        best: dict[ReplicaId, int] = {}
        for _, replica, chain in recent:
            if is_exact(matches.get(replica)):
                best[replica] = max(best.get(replica, 0), common_chain_prefix(chain, ctx.block_hashes))
        out = dict(matches)
        prompt = max(ctx.est_prompt_tokens, 0)
        for replica, blocks in best.items():
            m = matches[replica]
            shared = min(blocks * ctx.block_tokens, prompt)
            if shared > m.blocks:
                out[replica] = PrefixMatch(m.device_blocks + shared - m.blocks, m.host_blocks)
        return out


class RoutingCore:
    def __init__(self, policy: Policy, rng: random.Random, *, resident_cache_s: float = RESIDENT_CACHE_S) -> None:
        self.policy = policy
        self.rng = rng
        self.resident_window_s = policy.resident_window_s  # sessions seen within it are resident
        self.resident_cache_s = resident_cache_s
        self._resident: tuple[float, Mapping[ReplicaId, int]] | None = None
        self.in_flight = InFlightChains()
        self._now_s = 0.0  # the time of the last ``inputs`` (``account`` follows it at once)
        self._exact_until_s = float("-inf")  # KV events answered within the in-flight window

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
        views = serving(tuple(replicas), ctx.model)  # the one model filter, before any policy
        self._now_s = now_s
        if any(is_exact(m) for m in matches.values()):
            self._exact_until_s = now_s + self.in_flight.window_s
        if session is None:  # shares a prefix with others: cover their prefills in flight
            matches = self.in_flight.overlay(now_s, ctx, matches)
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
        """The session just routed is resident on its replica from now on, and its chain is
        in flight there."""
        if self._now_s <= self._exact_until_s:  # precise replicas in the fleet: cover their prefills
            self.in_flight.add(self._now_s, decision.replica, ctx.block_hashes)
        if self._resident is None or ctx.session.session is None:
            return
        taken_s, resident = self._resident
        updated = dict(resident)
        updated[decision.replica] = updated.get(decision.replica, 0) + ctx.est_prompt_tokens + (ctx.max_tokens or 0)
        self._resident = (taken_s, updated)
