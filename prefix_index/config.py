"""Configuration of the prefix index (a section of the gateway's one settings object).

See prefix_index/README.md for what each parameter does and why it has its default.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from prefix_index.base import ReplicaCapacity


class IndexConfig(BaseModel):
    backend: Literal["memory", "compact", "redis"] = Field(
        default="memory",
        description=(
            "memory: the embedded index, its representation chosen by fleet size (segments below 32 "
            "replicas; from 32 on flat arrays, ~18 B per block and a lookup that does not walk every replica: "
            "prefix_index/local_index.py); compact: the flat arrays at any fleet size; redis: shared by "
            "several gateways"
        ),
    )
    mode: Literal["auto", "approximate"] = Field(
        default="auto",
        description=(
            "auto: replicas advertising KV events in /server_info are matched precisely from their events "
            "(the others approximately); approximate: never subscribe, match every replica approximately"
        ),
    )
    tokenizer_dir: str | None = Field(
        default=None,
        description="precise mode: the model directory (tokenizer.json, or Kimi's tiktoken.model + "
                    "tokenization_kimi.py; tokenizer_config.json) when a replica's model_path is not a local "
                    "directory",
    )
    precise_tokenize_workers: int = Field(
        default=1, ge=1,
        description="precise mode: threads that tokenize and page-hash prompts off the event loop "
                    "(gateway/precise_pool.py); 1 keeps a core of a 2-core pod for the loop",
    )
    precise_tokenize_queue_requests: int = Field(
        default=16, ge=0,
        description="precise mode: prompts waiting for a tokenizer thread at most (requests); one more is "
                    "routed approximately at once",
    )
    precise_heavy_chars: int = Field(
        default=16384, ge=0,
        description="precise mode: a prompt the gateway has not seen (no session chain) longer than this "
                    "(characters) is tokenized in the heavy lane of the pool; the others (later turns, small "
                    "prompts) in its light lane, so they never wait behind a long first turn",
    )
    precise_tokenize_deadline_s: float = Field(
        default=2.0, gt=0,
        description="precise mode: a request waits this long at most for its prompt's token ids (seconds); "
                    "then it is routed approximately and the work finishes in the background (cached for the "
                    "next turn)",
    )
    event_lease_ttl_s: float = Field(
        default=5.0, gt=0,
        description="precise mode on Redis: a gateway holds a replica's event stream for this long unless it "
                    "renews (every third of it); another gateway takes over when it lapses",
    )
    event_max_message_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024,
        description="precise mode: the largest KV-event message part a subscriber accepts (ZMQ_MAXMSGSIZE, "
                    "bytes); a larger one drops the publisher's connection (its batches then show as a gap)",
    )
    event_receive_hwm_messages: int = Field(
        default=16, ge=1,
        description="precise mode: KV-event messages queued per subscriber socket before ZMQ drops more "
                    "(ZMQ_RCVHWM, messages; a drop shows as a gap: the replica is uncertain until "
                    "rebuilt); memory is bounded by this times event_max_message_bytes (256 MiB a socket at "
                    "the defaults; 256 messages let a flood reach 555 MB RSS, tests/safety/test_kv_event_flood.py)",
    )
    event_max_dp_size: int = Field(
        default=64, ge=1,
        description="precise mode: a replica advertising more DP ranks (publisher sockets) than this is "
                    "refused (routed approximately, a WARNING logged) instead of binding a socket per rank",
    )
    event_apply_slice_hashes: int = Field(
        default=4096, ge=1,
        description="precise mode: page hashes applied to the index before yielding to the event loop "
                    "(hashes), so a huge batch never stalls the requests being served",
    )
    event_restart_backoff_min_s: float = Field(
        default=0.5, gt=0,
        description="precise mode: first delay before restarting a stopped KV-event subscriber (seconds); "
                    "doubled on each consecutive stop",
    )
    event_restart_backoff_max_s: float = Field(
        default=30.0, gt=0,
        description="precise mode: the cap of the subscriber restart delay (seconds); a subscriber that ran "
                    "this long before stopping restarts after the first delay again",
    )
    redis_url: str | None = Field(default=None, description="redis://host:port/db; selects the Redis backend")
    key_prefix: str = Field(default="kvgate", description="Redis key prefix, so several fleets share one Redis")
    session_ttl_s: float = Field(default=14400.0, description="forget a session this long after its last turn")
    max_sessions: int = Field(
        default=1_000_000, ge=1,
        description="session table size bound: one more evicts the least recently used session (~400 B each)",
    )
    block_ttl_s: float = Field(default=3600.0, description="Redis: a replica's block set expires when untouched this long")
    redis_timeout_s: float = Field(default=0.05, description="Redis budget per call; slower counts as degraded")
    default_device_blocks: int = Field(
        default=16384, ge=0, description="device LRU size of a replica whose capacity is not known yet (blocks)"
    )
    default_host_blocks: int = Field(
        default=0, ge=0, description="host LRU size of a replica whose capacity is not known yet (blocks)"
    )
    redis_exact_match: bool = Field(
        default=False,
        description=(
            "Redis: per-block recency and a full-check match, exact for any hash list (slower); "
            "default: per-segment recency with a chain search, exact for chained hashes"
        ),
    )
    redis_write_behind: bool = Field(
        default=True,
        description="Redis: writes update the local copy and the pending writes at once and queue the "
        "Redis write (bounded, pipelined, flushed at shutdown: prefix_index/write_behind.py), off the "
        "path to the first byte; false: each write awaits its script",
    )
    redis_flush_interval_s: float = Field(default=0.002, gt=0, description="write-behind: max wait before a flush")
    redis_queue_max: int = Field(default=10000, ge=1, description="write-behind: queued writes kept (oldest dropped)")
    redis_visible_wait_s: float = Field(
        default=0.25, ge=0,
        description="write-behind: a response's last byte waits at most this long for the writes this gateway "
        "queued before it to reach Redis, so other gateways see a turn before its next one (seconds; a longer "
        "wait is counted as degraded; 0: never wait)",
    )
    redis_max_connections: int = Field(
        default=100, ge=1, description="Redis connections per process; beyond, a call waits (within its budget)"
    )
    redis_session_sync_s: float = Field(
        default=1.0, ge=0,
        description="Redis: copy other gateways' sessions into the local copy this often (0: never)",
    )
    redis_retry_s: float = Field(default=1.0, gt=0, description="while degraded: ping Redis this often")
    redis_recovery_merge_s: float = Field(
        default=600.0, ge=0, description="after Redis came back empty: also answer from the local copy this long"
    )

    @property
    def default_capacity(self) -> ReplicaCapacity:
        """A replica's LRU sizes until its capacity is known."""
        return ReplicaCapacity(self.default_device_blocks, self.default_host_blocks)
