"""The ``upstream`` section of the settings: how the gateway talks to replicas.

Timeouts, retries, the retry budget, the connection pool, TLS to ``https://`` replicas,
header forwarding and the replica API key. Durations carry their unit in the name. gateway/proxy.py's docstring
draws which timeout bounds which phase of a request and what happens when it fires.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, FilePath, SecretStr, model_validator


class UpstreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "client" in data:
            raise ValueError("upstream.client was removed: aiohttp is the one upstream client")
        return data

    connect_timeout_s: float = Field(default=2.0, gt=0, description="TCP connect to a replica")
    head_timeout_s: float = Field(
        default=10.0, gt=0,
        description="streaming requests: from sending to the response head (SGLang sends stream headers at "
        "once, so a longer wait means a hung replica); the attempt is retried elsewhere",
    )
    first_byte_timeout_s: float = Field(
        default=300.0, gt=0,
        description="streaming requests: from the response head to the first body chunk (queueing + "
        "prefill); the attempt is aborted and retried elsewhere",
    )
    stall_timeout_s: float = Field(
        default=60.0, gt=0,
        description="streaming requests: longest silence between two chunks after the first; the stream "
        "ends with an SSE error event and [DONE]",
    )
    total_timeout_s: float = Field(
        default=900.0, gt=0,
        description="non-streaming requests: the whole exchange; a slow generation is never resent, it "
        "ends with 504 here",
    )
    read_timeout_s: float = Field(
        default=120.0, gt=0,
        description="non-streaming requests: longest silence while reading a body after its head",
    )
    max_retries: int = Field(
        default=2, ge=0, description="extra attempts on other replicas when one fails before the first byte"
    )
    retry_budget_ratio: float = Field(
        default=0.2, ge=0, le=1,
        description="retries in flight may be at most this fraction of the requests in flight (Envoy's "
        "retry budget) ...",
    )
    retry_budget_min: int = Field(
        default=3, ge=0, description="... or this many, whichever is larger; beyond it the first error is returned"
    )
    poison_ttl_s: float = Field(
        default=300.0, gt=0,
        description="a body that got a 5xx from two replicas is remembered this long: its copies get no retry",
    )
    poison_max_entries: int = Field(default=4096, ge=1, description="bodies remembered as poison at most (LRU)")
    reserve_margin: float = Field(
        default=0.05, ge=0, le=1,
        description="shared state only: replicas scoring within this of the policy's pick are interchangeable; "
        "reserve() takes the least loaded of them across gateways (0: always the pick)",
    )
    max_connections: int = Field(
        default=1024, ge=1, description="upstream connection pool size (all replicas), keep-alive"
    )
    max_connections_per_replica: int = Field(
        default=0, ge=0, description="connections to one replica at most (0: no limit beyond max_connections)"
    )
    keepalive_timeout_s: float = Field(
        default=4.0, gt=0,
        description="close an idle pooled connection after this; under uvicorn's 5 s (SGLang's server), so "
        "the gateway never writes into a connection the replica is closing",
    )
    forward_authorization: bool = Field(
        default=False, description="forward the client's Authorization header to replicas"
    )
    replica_api_key: SecretStr | None = Field(
        default=None,
        description="sent to replicas as 'Authorization: Bearer <key>' (SGLang --api-key); replaces the client's",
    )
    tls_ca_file: FilePath | None = Field(
        default=None,
        description="PEM bundle of the CA certificates that sign https:// replicas' certificates; only these "
        "are trusted then (None: the system trust store). A replica's certificate must name the host or IP of "
        "its URL",
    )
    tls_verify: bool = Field(
        default=True,
        description="verify https:// replicas' certificates. DANGER: false accepts any certificate, so the "
        "link is encrypted but not authenticated: whoever can intercept it can read prompts and answers and "
        "the replica API key, and answer in the replica's name. For a throwaway test cluster only; give "
        "tls_ca_file instead",
    )

    @model_validator(mode="after")
    def _one_tls_choice(self) -> UpstreamConfig:
        if self.tls_ca_file is not None and not self.tls_verify:
            raise ValueError("upstream.tls_ca_file is set but upstream.tls_verify is false: choose one")
        return self
