"""The in-memory workload model every loader and generator produces, and drivers consume.

A `Workload` is a set of `Session`s; a session is an ordered list of `Turn`s (requests).
Text is not stored: a turn carries the chained block hash ids of its prompt (namespaced
by its session's ``namespace``) and its token counts; `loadtest.prompts` turns them into
messages. Hash ids are stored delta-encoded (``shared_blocks`` with the previous turn of
the same session, then the ``new_hash_ids``), because consecutive turns of an agent
session share almost their whole prefix: the 360 Claude Code sessions hold ~40M ids
turn by turn but ~2M new ones.

Timing: a closed-loop session sends turn ``i`` ``think_time_s`` after the response to
turn ``i-1`` ended (and after the subagents started by turn ``i-1`` finished). An
open-loop workload (``open_loop=True``) sends every turn at its ``arrival_s``.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Turn:
    think_time_s: float  # wait after the previous response of this session (closed loop)
    in_tokens: int  # prompt tokens in the trace
    out_tokens: int  # output tokens in the trace (sent as max_tokens with ignore_eos)
    shared_blocks: int  # leading hash ids equal to the previous turn's
    new_hash_ids: tuple[int, ...]  # the hash ids after those
    arrival_s: float = 0.0  # open loop: send time since the start of the trace
    subagents: tuple[Session, ...] = ()  # started after this turn's response
    kind: str = "n"  # trace request type ("n", "s", "tool", "user", "compaction", ...)


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    namespace: str  # hash ids mean something only within a namespace
    block_size: int  # tokens per hash block
    turns: tuple[Turn, ...]
    system_blocks: int = 0  # leading blocks rendered as the system message
    headers: Mapping[str, str] = field(default_factory=dict)
    parent: str | None = None  # parent session id (subagents)
    start_delay_s: float = 0.0  # subagent: delay after the parent's response

    def hash_id_lists(self) -> Iterator[list[int]]:
        """The full hash id list of each turn, in order (rebuilt from the deltas)."""
        current: list[int] = []
        for turn in self.turns:
            del current[turn.shared_blocks:]
            current.extend(turn.new_hash_ids)
            yield current

    def request_count(self) -> int:
        """Requests of this session and of all its subagents."""
        return len(self.turns) + sum(s.request_count() for t in self.turns for s in t.subagents)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    open_loop: bool = False  # replay at recorded arrival times (Mooncake, Bailian)

    def request_count(self) -> int:
        return sum(s.request_count() for s in self.sessions)

    def limited(self, max_sessions: int | None) -> Workload:
        if max_sessions is None or max_sessions >= len(self.sessions):
            return self
        return Workload(self.name, self.sessions[:max_sessions], self.open_loop)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two lists, with C-speed slice comparisons.

    The common case (``b`` extends ``a``) costs one comparison; otherwise a binary
    search over slice equality (prefix equality is monotone in the length).
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def delta_encode(previous: Sequence[int], current: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """(shared_blocks, new_hash_ids) of ``current`` relative to ``previous``."""
    shared = common_prefix_len(previous, current)
    return shared, tuple(current[shared:])
