"""What the in-process backends (``memory``, ``segments``, ``compact``) share: reads and
writes that never wait (the async methods of ``PrefixIndex`` call the synchronous ones),
the session half (``SessionMethods``), and ``stats`` from each replica's tier sizes."""
from __future__ import annotations

from collections.abc import Sequence

from prefix_index.base import BlockHash, IndexStats, PrefixMatch, ReplicaId
from prefix_index.session_table import SessionMethods


class EmbeddedMethods(SessionMethods):
    concurrent_reads = False  # in-process: every read answers without waiting

    def match_now(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        raise NotImplementedError

    def record_now(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        raise NotImplementedError

    def tier_blocks(self) -> dict[ReplicaId, tuple[int, int]]:
        """Per replica: (device blocks, host blocks) held."""
        raise NotImplementedError

    async def match(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        return self.match_now(hashes, replicas)

    async def record(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        self.record_now(replica, hashes)

    async def stats(self) -> IndexStats:
        tiers = self.tier_blocks()
        return IndexStats(
            device_blocks={rid: device for rid, (device, _) in tiers.items()},
            host_blocks={rid: host for rid, (_, host) in tiers.items()},
            sessions=len(self.sessions),
            session_evictions=self.sessions.evictions,
        )

    def replicas(self) -> list[ReplicaId]:
        return list(self.tier_blocks())

    async def close(self) -> None:
        return None
