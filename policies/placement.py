"""Where a NEW session should live: the placement term of the `cache-aware` cost model.

A coding-agent session's first turn is its cheapest moment to be placed: it will grow
turn by turn (the Claude Code sessions reach ~100k tokens) and stay on the replica it
starts on, because every later move recomputes its whole KV. Only the part of the first
prompt that other sessions share (a system prompt, tools) is cached anywhere, so
starting elsewhere costs the recompute of that shared prefix, once.

Predict-on-route makes the cheapest first turn a trap: the first session of a burst
records the shared system prompt on its replica, and every later new session sees the
cheapest TTFT there (a short uncached tail against a full prefill anywhere else). 18 new
sessions sharing an 8,000-word system prompt all landed on one replica.

The term, for a *new* session on candidate replica r (a session key with no session
entry yet, and not a subagent's first turn, whose home is its parent's replica) when
some replica holds part of its prompt (with nothing cached anywhere every replica pays
the whole prefill, and the crowd, eviction and ``new-session`` terms already place it
by the working set; the trap is the shared prefix):

    placement_s(r) = spread_weight * max(resident_r - mean_resident, 0) / prefill_tokens_per_s
                   + abandon_weight * (sole_match - cached_r) / prefill_tokens_per_s

``resident_r`` is the working set of the live sessions on r (``inputs.resident_tokens``:
the gateway's router adds each routed session at once, so decisions in a burst see the
ones made just before them) and ``mean_resident`` its mean over the candidates. The
excess is what r holds beyond its fair share of the fleet's sessions (the mean is over
the replicas of the snapshot): the KV that would have to move (be recomputed elsewhere)
for the fleet to be balanced. Placing the new session on a replica at or below the mean
costs nothing; above it, the session pays, in seconds, the recompute of that excess.

``sole_match`` is the prompt's longest match when ONE replica alone holds any of it (else
0), and ``cached_r`` what r holds of it: starting elsewhere *leaves* that KV, priced as
the cost model prices a move (``abandon_weight`` x its recompute). The gateway cannot
tell a prefix other sessions share (a system prompt, tools) from a session's own
history: a session back after its entry expired (``index.session_ttl_s``, four hours) has
no entry, and its match, its whole conversation on one replica, is lost for good by a
start elsewhere. A prefix two replicas hold is shared (a history lives on one replica),
and recomputing it on a third seeds that replica for the next new sessions: no abandon
charge. (The 32,768-token bound on the match that this charge replaced made the term
vanish for longer shared prompts: 18 sessions sharing a 30,000-word, ~56k-token prompt
all went to one replica.)

Why the rule holds for any prompt length and any profile: every term is in units of the
prompt, none is a token constant. Starting away from a P-token match costs its
recompute (P) and the queue externality (0.5 P), plus P while one replica alone holds
it; staying costs the excess, and each session stacked on a replica holding the prompt
adds its own working set (at least P) to that excess. So the first holder takes a few
sessions (until its excess passes about 2.5 P), a second replica gets the prompt, and
from then on a replica leaves the holders' club once their excess passes about 1.5 P,
whether P is 4k or 56k tokens: 18 sessions on 3 replicas split 6/6/6 in the unit tests
at 3.7k, 10.7k, 15k and 56k tokens. The excess is measured against the mean, so on a
larger fleet a replica that no burst session reached yet joins late: 18 sessions on 8
replicas land 2-3 per replica on 6-8 of them. A *long* match stays where a short one
would leave: a session's own 150k-token history leaves its replica only when that
replica holds some 375k tokens more than the fleet's mean, and a prefix far larger than
a session's share of the fleet (a long shared document, ``inputs.resident_tokens``
small) still wins.

Why spread_weight 1.0: the cost model already charges a move of a live session
``abandon_weight`` (1.0) x the recompute of the KV it leaves; an excess of working set
placed now is, at worst, KV someone moves later, so it is charged at the same rate.
Sessions that already have a replica are never charged (affinity decides for them), nor
are requests without a session key (no session will live anywhere: Mooncake-style
traffic). Measured in docs/benchmarks.md, section 1.8 (bursts over real processes, and
the Claude Code replay against the rule with the 32,768-token bound and the variants
tried).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

from policies.base import RequestContext, RoutingInputs
from replicas.model import ReplicaView


def is_new_conversation(ctx: RequestContext, inputs: RoutingInputs) -> bool:
    """A session key with no session entry, and not a subagent's first turn."""
    return (
        ctx.session.session is not None
        and inputs.session is None
        and inputs.parent_session is None
    )


def shared_prefix_tokens(ctx: RequestContext, inputs: RoutingInputs) -> int:
    """Tokens of the prompt's longest match on any replica (for a new session: what it shares)."""
    best = max((m.blocks for m in inputs.matches.values()), default=0)
    return min(best * ctx.block_tokens, max(ctx.est_prompt_tokens, 0))


def mean_resident_tokens(inputs: RoutingInputs) -> float | None:
    """The snapshot's mean resident working set per replica (None without replicas)."""
    ids = [r.id for r in inputs.replicas]
    if not ids:
        return None
    return sum(map(inputs.resident_tokens.get, ids, repeat(0))) / len(ids)


def excess_resident_tokens(inputs: RoutingInputs, view: ReplicaView) -> float:
    """The replica's resident working set above the candidates' mean (0 when at or below)."""
    mean = mean_resident_tokens(inputs)
    return 0.0 if mean is None else max(inputs.resident_tokens.get(view.id, 0) - mean, 0.0)


@dataclass(frozen=True, slots=True)
class Placement:
    """What the placement term needs, the same for every candidate of one decision."""

    mean_resident: float  # the candidates' mean resident working set
    sole_match_tokens: int  # the longest match when one replica alone holds it, else 0


def placement(ctx: RequestContext, inputs: RoutingInputs, weight: float) -> Placement | None:
    """The placement term's fleet-wide inputs when it applies to this request, else None
    (the term is 0 everywhere). Computed once per decision; the per-replica part (the
    formula above) is a term of `policies.ttft_cost`'s model."""
    if weight <= 0 or not is_new_conversation(ctx, inputs):
        return None
    shared = shared_prefix_tokens(ctx, inputs)
    mean = mean_resident_tokens(inputs)
    if shared <= 0 or mean is None:
        return None
    holders = sum(1 for m in inputs.matches.values() if m.blocks)
    return Placement(mean, shared if holders == 1 else 0)
