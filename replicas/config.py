"""Configuration of the replica registry (a section of the gateway's one settings object)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class RegistryConfig(BaseModel):
    replicas: list[str] = Field(default_factory=list, description="static replica URLs")
    discovery: Literal["static", "dns", "kubernetes"] = "static"
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 2.0
    unhealthy_after_failures: int = 3
    healthy_after_successes: int = 2
    loads_poll_interval_s: float = 1.0
    drain_timeout_s: float = 600.0
    # dns discovery
    dns_name: str | None = None
    dns_port: int = 30000
    dns_interval_s: float = 10.0
    # kubernetes discovery
    k8s_namespace: str | None = None
    k8s_service: str | None = None
    k8s_port_name: str | None = None
