"""Configuration of the replica registry (a section of the gateway's one settings object).

Durations carry their unit in the name. The defaults follow the SGLang router's
hysteresis (3 failures to go unhealthy, 2 successes to recover) and SGLang's own probes
(`/ready` is cheap, so probing every 2 s costs nothing). `shared` turns on the Redis
shared state (membership, drains, load leases) used when several gateways run together;
see replicas/README.md. `outlier` is the passive side: replicas that fail many distinct
requests are ejected for a while (replicas/outlier.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from replicas.urls import parse_replica_url


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


class OutlierConfig(BaseModel):
    """``registry.outlier``: when a replica is ejected, and for how long."""

    enabled: bool = Field(default=True, description="eject replicas that fail many distinct requests")
    consecutive_failures: int = Field(default=5, ge=1, description="failures in a row that eject")
    window_s: float = Field(default=30.0, gt=0, description="sliding window of the failure-rate rule")
    min_requests: int = Field(default=10, ge=1, description="results in the window before the rate rule applies")
    failure_fraction: float = Field(default=0.5, gt=0, le=1, description="failure fraction that ejects ...")
    fleet_margin: float = Field(default=0.3, ge=0, le=1,
                                description="... when also this far above the fleet's median fraction")
    base_ejection_s: float = Field(default=30.0, gt=0, description="ejection time x ejections so far ...")
    max_ejection_s: float = Field(default=300.0, gt=0, description="... capped at this")
    max_ejection_percent: float = Field(default=50.0, ge=0, le=100,
                                        description="active replicas ejected at once at most")
    eject_on_probe_timeout: bool = Field(default=True,
                                         description="a probe that times out ejects at once until a probe answers")


class RegistryConfig(BaseModel):
    # declared before ``replicas``: that field's validator reads it
    allow_link_local_replicas: bool = Field(
        default=False,
        description="accept link-local replica addresses (169.254.0.0/16, fe80::/10) and cloud metadata "
        "services (169.254.169.254, fd00:ec2::254, metadata.google.internal, ...: replicas/urls.py); off, "
        "they are refused in the config, the admin API and discovery, so no replica URL can reach the "
        "credentials a metadata service hands out",
    )
    replicas: list[str] = Field(default_factory=list, description=(
        "static replica URLs, each kept in its canonical spelling (replicas/urls.py): one replica is one entry"))
    discovery: Literal["static", "dns", "kubernetes"] = "static"
    learn_speeds: bool = Field(default=True, description=(
        "learn each replica's prefill rate and decode step from the requests it serves (replicas/speed.py) "
        "and price it by them; off, every replica gets the policy's fleet-wide constants"))
    probe_interval_s: float = Field(default=2.0, description=(
        "readiness probe of every replica this often (a self-drain or death is seen within it); "
        "~0.2 ms CPU a GET plus the wake-up: docs/benchmarks.md section 3"))
    probe_timeout_s: float = 2.0
    unhealthy_after_failures: int = 3
    healthy_after_successes: int = 2
    loads_poll_interval_s: float = Field(default=1.0, description=(
        "`/v1/loads` of every serving replica this often (load not routed by this gateway); "
        "the largest background cost: polls slowed to 5 s / 10 s took bench peers from 1.06x to 0.96-0.99x "
        "sglang-router's CPU a request"))
    poll_batch: int = Field(default=16, ge=0, description=(
        "replicas probed (and load-polled) at once at most: a larger fleet is probed in batches spread "
        "evenly over the interval, so the event loop never runs a fleet-wide burst of GETs "
        "(0: every replica at once)"))
    drain_timeout_s: float = 600.0
    drain_check_interval_s: float = Field(
        default=0.25, description="how often drain deadlines are checked while a replica drains (no wake-ups otherwise)"
    )
    readd_static_after_self_drain: bool = Field(
        default=True,
        description="a static replica that drained itself (SIGTERM, /ready 503) and was removed "
        "is added back as joining, so a restart at the same URL rejoins",
    )
    shared: SharedStateConfig = Field(default_factory=SharedStateConfig)

    @field_validator("replicas")
    @classmethod
    def _urls(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        """Every static replica is a usable http(s)://host:port URL (``replicas.urls``),
        kept canonical and once: the registry's ids, its static set and discovery all read
        this list, so two spellings of one replica must not become two replicas."""
        allow = bool(info.data.get("allow_link_local_replicas", False))
        # ReplicaUrlError is a ValueError: pydantic reports it
        canonical = [parse_replica_url(url, allow_link_local=allow) for url in urls]
        return list(dict.fromkeys(canonical))

    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    probe_log_interval_s: float = Field(
        default=30.0, gt=0,
        description="a failing probe is logged at WARNING on its first failure, then at most this often",
    )
    # dns discovery
    dns_name: str | None = None
    dns_port: int = 30000
    dns_interval_s: float = 10.0
    # kubernetes discovery
    k8s_namespace: str | None = None
    k8s_service: str | None = Field(default=None, description=(
        "watch the EndpointSlices of this Service (one replica pool); k8s_selector instead for several"))
    k8s_selector: str | None = Field(default=None, description=(
        "watch every EndpointSlice matching this label selector (e.g. 'kvgate.io/replicas=true': one "
        "per replica pool's Service, whose labels Kubernetes copies onto its slices); wins over k8s_service"))
    k8s_port_name: str | None = None
