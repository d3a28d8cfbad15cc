"""The synthetic generator: seeded, and its statistics roughly as parameterised."""
from __future__ import annotations

from loadtest.percentile import percentile
from loadtest.synthetic import SyntheticParams, generate
from loadtest.workload import Session, Turn


def _walk(sessions: tuple[Session, ...]) -> list[tuple[Session, Turn]]:
    out: list[tuple[Session, Turn]] = []
    for s in sessions:
        for t in s.turns:
            out.append((s, t))
            out.extend(_walk(t.subagents))
    return out


def test_seeded() -> None:
    p = SyntheticParams(sessions=5)
    assert generate(p, seed=3) == generate(p, seed=3)
    assert generate(p, seed=3) != generate(p, seed=4)


def test_statistics_match_the_published_figures() -> None:
    w = generate(SyntheticParams(sessions=200), seed=11)
    pairs = _walk(w.sessions)
    ins = [float(t.in_tokens) for _, t in pairs]
    outs = [float(t.out_tokens) for _, t in pairs]
    turns = [float(len(s.turns)) for s in w.sessions]
    assert 70_000 < (percentile(ins, 50) or 0) < 140_000  # trace p50 103,662
    assert 170_000 < (percentile(ins, 90) or 0) < 320_000  # trace p90 233,633
    assert 170 < (percentile(outs, 50) or 0) < 270  # trace p50 216
    assert 700 < (percentile(outs, 90) or 0) < 1100  # trace p90 898
    assert 35 < (percentile(turns, 50) or 0) < 60  # trace p50 46
    shared = sum(t.shared_blocks * s.block_size for s, t in pairs)
    assert shared / sum(ins) > 0.9  # trace: ideal hit rate 96.3%
    thinks = [t.think_time_s for _, t in pairs if t.think_time_s > 0]
    assert (percentile(thinks, 10) or 0) < 0.5 and (percentile(thinks, 99) or 0) > 60


def test_shared_system_prompt_subagents_and_compaction() -> None:
    w = generate(SyntheticParams(sessions=60), seed=2)
    firsts = [s.turns[0].new_hash_ids[: s.system_blocks] for s in w.sessions]
    assert len(set(firsts)) == 1 and len(firsts[0]) == (12_400 + 3_000) // 64
    subs = [sub for s in w.sessions for t in s.turns for sub in t.subagents]
    assert subs and all(sub.parent is not None for sub in subs)
    assert all("x-claude-code-parent-agent-id" in sub.headers for sub in subs)
    compactions = [(s, t) for s in w.sessions for t in s.turns if t.kind == "compaction"]
    assert compactions
    assert all(t.shared_blocks == s.system_blocks for s, t in compactions)


def test_scaled_params_keep_the_shape() -> None:
    p = SyntheticParams(sessions=20).scaled(0.01)
    w = generate(p, seed=1)
    ins = [float(t.in_tokens) for _, t in _walk(w.sessions)]
    assert (percentile(ins, 50) or 0) < 3_000
    assert p.turns_median == SyntheticParams().turns_median
