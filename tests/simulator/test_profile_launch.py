"""One source of truth for a replica's hardware: the simulator profile derives the launch's facts."""
from __future__ import annotations

import pytest

from loadtest.simulator.profile import ProfileError, load_profile, profile_from_dict
from replicas import sglang_args


def test_kimi_profile_takes_the_launch_from_the_launch_profile() -> None:
    sim = load_profile("kimi-k2.6-b200-tp8")
    launch = sglang_args.load_profile("kimi-k2.6-tp8-dflash")
    assert (sim.served_model_name, sim.tp_size, sim.page_size, sim.max_running_requests,
            sim.chunked_prefill_size, sim.context_length, sim.spec_algorithm) == (
        launch.served_model_name, launch.tp_size, launch.page_size, launch.max_running_requests,
        launch.chunked_prefill_size, launch.context_length, launch.speculative_algorithm)
    assert sim.host_tokens == int((launch.hicache_ratio or 0) * sim.device_tokens)
    assert sim.spec_num_draft_tokens == launch.speculative_dflash_block_size


def test_a_launch_fact_set_twice_is_an_error() -> None:
    with pytest.raises(ProfileError, match="come from launch profile"):
        profile_from_dict({"launch_profile": "kimi-k2.6-tp8-dflash", "page_size": 16, "device_tokens": 1000},
                          "bad")
    with pytest.raises(ProfileError):
        profile_from_dict({"launch_profile": "no-such-launch"}, "bad")
