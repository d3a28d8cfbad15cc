"""The oracle's cache hit rate over the requests a real run actually sent.

`kvgate simulate` compares every policy with an oracle (infinite cache, perfect
affinity). A run over real HTTP (`kvgate loadtest`, `kvgate bench peers`, `kvgate demo`)
sends a time-bounded, concurrency-dependent subset of the workload, so its bound must be
computed over exactly those requests: in send order, each request's cached tokens under
the oracle are the longest prefix of its (namespaced) hash chain seen in any earlier
request, times the block size, at most the prompt tokens the replica reported.
"""
from __future__ import annotations

from collections.abc import Iterable

from loadtest.fleetsim.oracle import Oracle
from loadtest.results import RequestRecord
from loadtest.workload import Session, Workload

Chain = tuple[list[int], int]  # namespaced block keys, block size in tokens


def _chains(workload: Workload) -> dict[tuple[str, int], Chain]:
    chains: dict[tuple[str, int], Chain] = {}

    def add(session: Session) -> None:
        for i, ids in enumerate(session.hash_id_lists()):
            keys = [hash((session.namespace, x)) for x in ids]  # ids mean something per namespace
            chains[(session.id, i)] = (keys, session.block_size)
            for sub in session.turns[i].subagents:
                add(sub)

    for session in workload.sessions:
        add(session)
    return chains


def oracle_hit_rate(workload: Workload, records: Iterable[RequestRecord]) -> float | None:
    """Cached / prompt tokens under the oracle, over the successful requests in ``records``."""
    chains = _chains(workload)
    oracle = Oracle()
    cached = prompt = 0
    for rec in sorted(records, key=lambda r: r.t_start_s):
        chain = chains.get((rec.session, rec.turn))
        if rec.status != 200 or rec.error or not rec.prompt_tokens or chain is None:
            continue
        keys, block_size = chain
        cached += oracle.cached_tokens(keys, block_size, rec.prompt_tokens)
        prompt += rec.prompt_tokens
        oracle.record(keys)
    return cached / prompt if prompt else None
