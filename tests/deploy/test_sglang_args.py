"""Replica profiles -> SGLang 0.5.23 arguments: semantic checks, generated files, and the
real SGLang argument parser (in the CPU SGLang venv of tools/sglang_cpu/install.sh)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from replicas import sglang_args
from replicas.sglang_args import (
    LaunchProfileError,
    SGLangProfile,
    build_args,
    load_profile,
    semantic_errors,
)

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "tools" / "sglang_cpu" / "install.sh"
CHECK = ROOT / "tools" / "sglang_argcheck" / "check.py"
DFLASH = load_profile("kimi-k2.6-tp8-dflash")


def with_(p: SGLangProfile, **changes: Any) -> SGLangProfile:
    return dataclasses.replace(p, **changes)


def test_dflash_profile_args() -> None:
    args = build_args(DFLASH)
    assert all(a.startswith("--") for a in args[::2] if a.startswith("-"))
    pairs = dict(itertools.pairwise(args))
    assert pairs["--tp-size"] == "8" and pairs["--page-size"] == "64"
    assert pairs["--speculative-algorithm"] == "DFLASH" and pairs["--speculative-draft-model-path"]
    assert "--speculative-num-steps" not in args and "--speculative-eagle-topk" not in args
    assert {"--enable-metrics", "--enable-cache-report", "--enable-hierarchical-cache"} <= set(args)
    assert json.loads(pairs["--kv-events-config"])["publisher"] == "zmq"


@pytest.mark.parametrize("changes, message", [
    ({"speculative_draft_model_path": None}, "DFLASH needs speculative_draft_model_path"),
    ({"pp_size": 2, "gpus": 16}, "DFLASH needs pp_size == 1"),
    ({"speculative_num_steps": 3}, "leave speculative_num_steps"),
    ({"speculative_num_draft_tokens": 8}, "must equal speculative_num_draft_tokens"),
    ({"speculative_algorithm": "EAGLE3", "speculative_dflash_block_size": None}, "EAGLE3 needs speculative_num_steps"),
    ({"speculative_algorithm": "bogus"}, "unknown speculative algorithm"),
    ({"hicache_ratio": 1.0}, "hicache_ratio must be > 1"),
    ({"hicache_write_policy": "sometimes"}, "hicache_write_policy"),
    ({"page_size": 0}, "page_size must be explicit"),
    ({"tp_size": 4}, "must equal gpus"),
    ({"mem_fraction_static": 1.2}, "mem_fraction_static"),
    ({"enable_cache_report": False}, "enable_cache_report"),
])
def test_semantic_errors(changes: dict[str, Any], message: str) -> None:
    profile = with_(DFLASH, **changes)
    assert any(message in e for e in semantic_errors(profile)), semantic_errors(profile)
    with pytest.raises(LaunchProfileError):
        build_args(profile)


def test_eagle_topk1_needs_steps_plus_one() -> None:
    eagle = load_profile("kimi-k2-tp8-eagle3")
    assert semantic_errors(eagle) == []
    assert "num_draft_tokens == num_steps + 1" in semantic_errors(with_(eagle, speculative_num_draft_tokens=8))[0]


def test_unknown_profile_key_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('model_path = "m"\nserved_model_name = "m"\npage_size = 16\ntp_sise = 8\n')
    with pytest.raises(LaunchProfileError, match="tp_sise"):
        load_profile(str(bad))


def test_check_detects_stale_generated_file(tmp_path: Path) -> None:
    assert sglang_args.stale_files(ROOT) == []
    assert sglang_args.stale_files(tmp_path) == list(sglang_args.GENERATED)
    sglang_args.write_files(tmp_path)
    assert sglang_args.stale_files(tmp_path) == []
    rel = next(iter(sglang_args.GENERATED))
    path = tmp_path / rel
    path.write_text(path.read_text().replace("'64'", "'32'"))
    assert sglang_args.stale_files(tmp_path) == [rel]


BAD_CASES: dict[str, tuple[list[str], int]] = {
    "abbreviation": (["--tp", "8"], 2),                          # rejected (allow_abbrev=False)
    "invalid-choice": (["--hicache-write-policy", "bogus"], 2),
    "unknown-algorithm": (["--speculative-algorithm", "BOGUS"], 3),  # argparse accepts; from_string not
}


@pytest.fixture(scope="module")
def real_parser() -> dict[str, dict[str, Any]]:
    """Every case through SGLang 0.5.23's parser in ONE subprocess (torch import is slow)."""
    where = subprocess.run(["bash", str(INSTALLER), "--where"], capture_output=True, text=True,
                           timeout=60, check=False)
    if where.returncode != 0:
        pytest.fail("the CPU SGLang venv is missing: run `bash .ci/sglang-argcheck.sh` first (it builds "
                    "it with tools/sglang_cpu/install.sh; CI runs it before the tests)\n" + where.stderr)
    venv_py = where.stdout.strip().splitlines()[-1]
    cases = {name: build_args(load_profile(name)) for name in sglang_args.profile_names()}
    cases.update({name: ["--model-path", "m", *bad] for name, (bad, _) in BAD_CASES.items()})
    out = subprocess.run([venv_py, str(CHECK), "--batch"], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, dict[str, Any]] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("name", sglang_args.profile_names())
def test_profiles_parse_with_sglang_0_5_23(real_parser: dict[str, dict[str, Any]], name: str) -> None:
    profile = load_profile(name)
    assert real_parser[name]["status"] == 0, real_parser[name]
    parsed = real_parser[name]["values"]
    assert parsed["sglang_version"] == "0.5.23"
    assert parsed["tp_size"] == profile.tp_size and parsed["page_size"] == profile.page_size
    assert parsed["enable_metrics"] and parsed["enable_cache_report"] and parsed["enable_hierarchical_cache"]
    assert parsed["hicache_ratio"] == profile.hicache_ratio
    assert parsed["speculative_algorithm_resolved"] == str(profile.speculative_algorithm).upper()
    assert parsed["speculative_draft_model_path"] == profile.speculative_draft_model_path
    assert parsed["kv_events_resolved"]["publisher"] == "zmq"
    assert parsed["kv_events_resolved"]["replay_endpoint"] == profile.kv_events_replay_endpoint == "tcp://*:5600"
    assert parsed["served_model_name"] == profile.served_model_name


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_real_parser_rejects_bad_args(real_parser: dict[str, dict[str, Any]], case: str) -> None:
    assert real_parser[case]["status"] == BAD_CASES[case][1], real_parser[case]
