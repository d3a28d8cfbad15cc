"""Configuration of the routing policy (a section of the gateway's one settings object)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class PolicyConfig(BaseModel):
    name: str = Field(default="cache-aware", description="policy name; see policies/README.md")
    params: dict[str, Any] = Field(default_factory=dict, description="per-policy parameters (overrides)")
    seed: int | None = Field(default=None, description="seed for tie-breaking randomness (None: random)")
