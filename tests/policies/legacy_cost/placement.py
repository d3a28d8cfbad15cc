"""Frozen copy of policies/placement.py before the once-per-replica restructuring (the reference
`test_cost_equivalence` checks the current code against; never edit)."""

from __future__ import annotations

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


def excess_resident_tokens(inputs: RoutingInputs, view: ReplicaView) -> float:
    """The replica's resident working set above the candidates' mean (0 when at or below)."""
    resident = inputs.resident_tokens
    ids = [r.id for r in inputs.replicas]
    if not ids:
        return 0.0
    mean = sum(resident.get(r, 0) for r in ids) / len(ids)
    return max(resident.get(view.id, 0) - mean, 0.0)


def spread_s(
    ctx: RequestContext,
    inputs: RoutingInputs,
    view: ReplicaView,
    weight: float,
    prefill_tokens_per_s: float,
    max_shared_tokens: int,
) -> float:
    """The placement term (seconds) of starting a new session on ``view`` (0 otherwise)."""
    if weight <= 0 or not is_new_conversation(ctx, inputs):
        return 0.0
    if not 0 < shared_prefix_tokens(ctx, inputs) <= max_shared_tokens:
        return 0.0
    return weight * excess_resident_tokens(inputs, view) / prefill_tokens_per_s
