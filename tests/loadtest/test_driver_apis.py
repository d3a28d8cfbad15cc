"""The driver over each API (``DriverConfig.api``): request shapes, stream grammars and
usage (cached tokens) per API, against a real simulated replica (tiny profile)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.driver import API_CHOICES, DriverConfig, drive
from loadtest.prompts import request_body
from loadtest.simulator.fleet import SimFleet
from loadtest.sse import StreamParser
from loadtest.synthetic import SyntheticParams, generate
from loadtest.workload import Workload

TIME_SCALE = 20.0
MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def test_request_bodies() -> None:
    chat = request_body("chat", "m", MESSAGES, 5, {})
    assert chat["messages"] == MESSAGES and chat["max_tokens"] == 5 and chat["stream_options"]["include_usage"]
    anthropic = request_body("messages", "m", MESSAGES, 5, {"temperature": 0})
    assert anthropic["system"] == "S" and anthropic["messages"] == MESSAGES[1:] and anthropic["max_tokens"] == 5
    assert anthropic["temperature"] == 0
    responses = request_body("responses", "m", MESSAGES, 5, {}, previous="resp_1")
    assert responses["instructions"] == "S" and responses["max_output_tokens"] == 5
    assert responses["input"] == [{"type": "message", "role": "user", "content": "U"}]
    assert responses["previous_response_id"] == "resp_1"
    with pytest.raises(ValueError):
        request_body("nope", "m", MESSAGES, 5, {})


ANTHROPIC = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":4,'
             b'"output_tokens":0,"cache_read_input_tokens":96}}}\n\n'
             b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
             b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
             b'"usage":{"output_tokens":2}}\n\n'
             b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


def test_anthropic_stream_any_split() -> None:
    for cut in range(1, len(ANTHROPIC), 11):
        p = StreamParser("messages")
        p.feed(ANTHROPIC[:cut], 1.0)
        p.feed(ANTHROPIC[cut:], 2.0)
        assert p.done and p.error is None and len(p.times) == 1
        assert p.usage == {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 96},
                           "completion_tokens": 2}


def test_agent_stream_errors() -> None:
    p = StreamParser("messages")
    p.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n', 0.0)
    assert p.error == "busy" and not p.done
    q = StreamParser("responses")
    q.feed(b'event: error\ndata: {"type":"error","code":"502","message":"broke","param":null}\n\n', 0.0)
    assert q.error == "broke"


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=TIME_SCALE, seed=2) as f:
        yield f


def _workload() -> Workload:
    p = SyntheticParams(sessions=2, turns_median=4, turns_p90=5, subagent_prob=0.0, block_size=16).scaled(0.02)
    return generate(p, 7)


@pytest.mark.parametrize(("api", "chain"), [(a, False) for a in API_CHOICES] + [("responses", True)])
async def test_each_api_against_a_simulated_replica(fleet: SimFleet, api: str, chain: bool) -> None:
    w = _workload()
    cfg = DriverConfig(target=fleet.urls[0], time_scale=TIME_SCALE, max_think_s=1.0, sessions_concurrent=2,
                       api=api, responses_chain=chain)
    records, _ = await drive(w, cfg)
    assert len(records) == w.request_count()
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert all(r.ttft_s is not None and r.ttft_s > 0 for r in records)
    assert all(r.output_tokens == r.trace_out_tokens for r in records)
    assert all(r.prompt_tokens is not None and r.prompt_tokens > 0 for r in records)
    later = [r for r in records if r.turn > 0]
    assert later and sum(r.cached_tokens or 0 for r in later) > 0.5 * sum(r.prompt_tokens or 0 for r in later)
