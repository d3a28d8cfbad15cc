"""Configuration of the prefix index (a section of the gateway's one settings object)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class IndexConfig(BaseModel):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = Field(default=None, description="redis://host:port/db; selects the Redis backend")
    key_prefix: str = Field(default="kvgate", description="Redis key prefix, so several fleets share one Redis")
    session_ttl_s: float = Field(default=3600.0, description="forget a session this long after its last turn")
    block_ttl_s: float = Field(default=3600.0, description="Redis: a replica's block set expires when untouched this long")
    redis_timeout_s: float = Field(default=0.05, description="Redis budget per call; slower counts as degraded")
