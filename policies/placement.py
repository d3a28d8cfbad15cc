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

``resident_r`` is the working set of the live sessions on r (``inputs.resident_tokens``:
the gateway's router adds each routed session at once, so decisions in a burst see the
ones made just before them) and ``mean_resident`` its mean over the candidates. The
excess is what r holds beyond its fair share of the fleet's sessions (the mean is over
the replicas of the snapshot): the KV that would
have to move (be recomputed elsewhere) for the fleet to be balanced. Placing the new
session on a replica at or below the mean costs nothing; above it, the session pays, in
seconds, the recompute of that excess. It is weighed against what the rest of the cost
model charges for starting away from the shared prefix (its uncached prefill plus the
queue externality): with ``spread_weight`` 1.0 a new session sharing a P-token prefix
leaves the replica holding it once that replica's excess exceeds about 1.5 P, so a
burst spreads to within about two sessions per replica, while a prefix far larger than
a session's share of the fleet (a long shared document, ``inputs.resident_tokens``
small) still wins.

Only a *shared* prefix counts: ``placement_max_shared_tokens`` (32,768) bounds the
match. A system prompt with tool schemas is 10k-30k tokens; a session without a
session entry whose prompt matches much more than that is almost always a session
coming back after its entry expired (an hour's pause), whose own KV is that match: it
is not new, and moving it recomputes its whole history (in the Claude Code replays,
~30 such turns per run lost 0.03-0.05 points of hit rate without this bound).

Why 1.0: the cost model already charges a move of a live session ``abandon_weight``
(1.0) x the recompute of the KV it leaves; an excess of working set placed now is, at
worst, KV someone moves later, so it is charged at the same rate. Sessions that already
have a replica are never charged (affinity decides for them), nor are requests without a
session key (no session will live anywhere: Mooncake-style traffic).
"""

from __future__ import annotations

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


def spread_mean(
    ctx: RequestContext, inputs: RoutingInputs, weight: float, max_shared_tokens: int
) -> float | None:
    """The mean resident working set when the placement term applies to this request, else
    None (the term is 0 everywhere). Computed once per decision (the mean and the longest
    match are the same for every candidate); the per-replica part, ``spread_weight`` x the
    working set above it / the prefill rate, is a term of `policies.ttft_cost`'s model."""
    if weight <= 0 or not is_new_conversation(ctx, inputs):
        return None
    if not 0 < shared_prefix_tokens(ctx, inputs) <= max_shared_tokens:
        return None
    return mean_resident_tokens(inputs)
