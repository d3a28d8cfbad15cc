"""How one simulated replica process is started (its own module: ``server.py`` and
``info.py`` both read it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loadtest.simulator.faults import FaultConfig
from loadtest.simulator.kv_publisher import KvEventsConfig
from loadtest.simulator.profile import Profile


@dataclass(frozen=True, slots=True)
class SimServerConfig:
    profile: Profile
    time_scale: float
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    faults: FaultConfig = field(default_factory=FaultConfig)
    model_dir: Path | None = None  # default: info.model_dir(profile)
    handle_sigterm: bool = False  # install the SGLang-like SIGTERM drain (the CLI does)
    kv_events: KvEventsConfig | None = None  # --kv-events-config (None: no events published)
