"""The simulated replica's Hugging Face tokenizer (loadtest/simulator/hf_tokenizer.py),
checked with the real ``transformers`` and ``tokenizers`` of the SGLang CPU venv: for any
chat, ``apply_chat_template`` renders exactly ``render_chat`` and the token count equals
the simulator's own (``len(encode(render_chat(...)))``).

Hypothesis generates the chats here; one worker process in the venv renders and counts
them (a JSON line per example), so the venv needs no test packages.
"""
from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.sglang_cpu.env import SGLangEnv
from loadtest.sglang_cpu.server import server_env
from loadtest.simulator.hf_tokenizer import write_tokenizer
from loadtest.simulator.tokenizer import encode, render_chat

pytestmark = pytest.mark.sglang_real

WORKER = r"""
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    text = tok.apply_chat_template(req["messages"], tools=req["tools"], tokenize=False)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    print(json.dumps({"text": text, "n": n}), flush=True)
"""


class Worker:
    def __init__(self, python: Path, model_dir: Path) -> None:
        self.proc = subprocess.Popen([str(python), "-c", WORKER, str(model_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=server_env())
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"messages": messages, "tools": tools}) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def worker(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    model_dir = tmp_path_factory.mktemp("sim-tokenizer")
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    write_tokenizer(model_dir, 8192)
    w = Worker(sglang_env.python, model_dir)
    yield w
    w.close()


texts = st.text(max_size=60)
scalars = st.one_of(st.integers(-10**6, 10**6), texts, st.booleans(), st.none())
json_objects = st.dictionaries(st.text(max_size=8), scalars, max_size=4)
contents = st.one_of(st.none(), texts,
                     st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), max_size=3))
tool_calls = st.lists(st.builds(lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}},
                                st.text(max_size=10), st.one_of(texts, json_objects)), max_size=2)


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": draw(st.sampled_from(["system", "user", "assistant", "tool"])),
                           "content": draw(contents)}
    if draw(st.booleans()):
        msg["name"] = draw(st.text(min_size=1, max_size=10))
    if msg["role"] == "assistant" and draw(st.booleans()):
        msg["tool_calls"] = draw(tool_calls)
    return msg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=st.lists(messages(), min_size=1, max_size=5),
       tools=st.one_of(st.none(), st.lists(json_objects, min_size=1, max_size=2)))
def test_template_and_count_match_the_simulator(worker: Worker, chat: list[dict[str, Any]],
                                                tools: list[Any] | None) -> None:
    got = worker.render(chat, tools)
    expected = render_chat(chat, tools)
    assert got["text"] == expected
    assert got["n"] == len(encode(expected))
