"""Configuration of the replica registry (a section of the gateway's one settings object).

Durations carry their unit in the name. The defaults follow the SGLang router's
hysteresis (3 failures to go unhealthy, 2 successes to recover) and SGLang's own probes
(`/ready` is cheap, so probing every 2 s costs nothing). `shared` turns on the Redis
shared state (membership, drains, load leases) used when several gateways run together;
see replicas/README.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class SharedStateConfig(BaseModel):
    """Redis-backed state shared by every gateway of one fleet (off when redis_url is None)."""

    redis_url: str | None = Field(
        default=None, description="redis://host:port/db; None = local state only"
    )
    key_prefix: str = Field(
        default="kvgate:replicas:", description="prefix of every key this package writes"
    )
    sync_interval_s: float = Field(
        default=0.25, description="publish own load, read membership/drains/loads"
    )
    lease_ttl_s: float = Field(
        default=3.0,
        description="a gateway's published load expires this long after its last refresh",
    )
    sync_budget_s: float = Field(
        default=0.25, description="a sync slower than this counts as degraded"
    )
    op_budget_s: float = Field(
        default=0.25, description="budget of one admin write (add/remove/drain)"
    )
    reserve_budget_s: float = Field(
        default=0.05, description="budget of one reserve(); slower: local choice"
    )
    reserve_slack_requests: int = Field(
        default=0,
        description="reserve() keeps the preferred replica unless it has more than this many "
        "requests in flight above the least loaded candidate",
    )


class RegistryConfig(BaseModel):
    replicas: list[str] = Field(default_factory=list, description="static replica URLs")
    discovery: Literal["static", "dns", "kubernetes"] = "static"
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 2.0
    unhealthy_after_failures: int = 3
    healthy_after_successes: int = 2
    loads_poll_interval_s: float = 1.0
    drain_timeout_s: float = 600.0
    drain_check_interval_s: float = Field(
        default=0.25, description="how often drain deadlines are checked"
    )
    readd_static_after_self_drain: bool = Field(
        default=True,
        description="a static replica that drained itself (SIGTERM, /ready 503) and was removed "
        "is added back as joining, so a restart at the same URL rejoins",
    )
    shared: SharedStateConfig = Field(default_factory=SharedStateConfig)
    # dns discovery
    dns_name: str | None = None
    dns_port: int = 30000
    dns_interval_s: float = 10.0
    # kubernetes discovery
    k8s_namespace: str | None = None
    k8s_service: str | None = None
    k8s_port_name: str | None = None
