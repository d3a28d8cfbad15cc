"""Values describing replicas, shared by the registry (writer) and policies (readers)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from prefix_index.base import ReplicaId


class ReplicaState(str, enum.Enum):
    """Lifecycle: joining -> active <-> unhealthy; active -> draining -> removed."""

    JOINING = "joining"
    ACTIVE = "active"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    REMOVED = "removed"


def memory_bound(device_tokens: int, context_tokens: int) -> bool:
    """A KV pool of ``device_tokens`` cannot hold one request of ``context_tokens`` (both
    known): such a replica runs few long requests at once, so they queue for memory."""
    return 0 < device_tokens < context_tokens


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A frozen snapshot of one replica, as policies see it at decision time.

    Load figures combine the gateway's own accounting (exact, immediate: a decision
    counts the moment it is made) with what the replica last reported on ``/v1/loads``
    (complete but stale by up to one poll interval).
    """

    id: ReplicaId
    state: ReplicaState
    # capacity, from /server_info (tokens)
    device_tokens: int = 0
    host_tokens: int = 0
    page_size: int = 64
    context_tokens: int = 0  # the longest context it serves (0 = unknown)
    max_running_requests: int = 0  # 0 = unknown
    # the model ids it serves, from /v1/models (empty: not known yet, or it reports none)
    models: frozenset[str] = frozenset()
    # the gateway's own accounting
    in_flight: int = 0  # requests routed here and not finished
    pending_prefill_tokens: int = 0  # predicted uncached tokens of requests not yet at first byte
    decoding: int = 0  # requests that are streaming output
    held_prefill: tuple[int, ...] = ()  # predicted uncached tokens of requests admission holds (included above)
    # what the replica reports on /v1/loads (0 when unknown)
    reported_running: int = 0
    reported_waiting: int = 0
    reported_waiting_uncached_tokens: int = 0
    reported_token_usage: float = 0.0
    # bookkeeping
    added_at_s: float = 0.0  # monotonic time the replica joined (new replicas get new sessions first)
    drain_deadline_s: float | None = None
    removal_candidate: bool = False  # scale-in chose this replica: steer its sessions away
    ejected: bool = False  # an outlier (replicas/outlier.py): no requests until its ejection ends
    # its own speed, learned from what the gateway observes (replicas/speed.py); None: the
    # policy's fleet-wide constant. decode_step_s: the time one stream takes to produce
    # DECODE_TOKENS_PER_STEP tokens (its accept length folded in)
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    # its speculative accept length from /v1/loads, smoothed (None: it reports none)
    spec_accept_length: float | None = None

    def prefill_ahead(self, uncached_tokens: int) -> int:
        """Predicted prefill tokens served before a new request of ``uncached_tokens`` here.

        Without admission (nothing held) the replica serves first come, first served: all
        of its queue, the gateway's pending prefill or the replica's reported one, whichever
        is larger (they overlap). With requests held (``replicas.admission``: released
        smallest first) only what was released and the held requests no larger than this
        one go first."""
        held = self.held_prefill
        queue = self.pending_prefill_tokens
        if not held:
            return max(queue, self.reported_waiting_uncached_tokens)
        released = max(0, queue - sum(held))
        return max(released, self.reported_waiting_uncached_tokens) + sum(x for x in held if x <= uncached_tokens)

    @property
    def memory_bound(self) -> bool:
        """Its KV pool is smaller than one request of the longest context it serves: long
        requests queue there for memory, not for compute (``replicas.admission``)."""
        return memory_bound(self.device_tokens, self.context_tokens)

    @property
    def routable(self) -> bool:
        """May receive requests of sessions it already serves."""
        return self.state is ReplicaState.ACTIVE and not self.ejected

    @property
    def accepts_new_sessions(self) -> bool:
        return self.routable and not self.removal_candidate
