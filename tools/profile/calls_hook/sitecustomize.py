"""Loaded by a child of ``tools/profile/calls.py`` (this directory on its PYTHONPATH): SIGUSR1
starts a deterministic profile (cProfile) of the process's main thread, SIGUSR2 stops it and
writes the stats to ``$KVGATE_CALLS_OUT``. Nothing happens without that variable."""
from __future__ import annotations

import cProfile
import os
import signal
import types

_OUT = os.environ.get("KVGATE_CALLS_OUT")
_profile: cProfile.Profile | None = None


def _start(signum: int, frame: types.FrameType | None) -> None:
    global _profile
    _profile = cProfile.Profile()
    _profile.enable()


def _stop(signum: int, frame: types.FrameType | None) -> None:
    global _profile
    if _profile is None or _OUT is None:
        return
    _profile.disable()
    _profile.dump_stats(_OUT + ".part")
    os.replace(_OUT + ".part", _OUT)  # whole or absent: the tool waits for the file
    _profile = None


if _OUT:
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
