"""``kvgate sglang-cpu --tokenizer tiktoken``: the TikToken-form test model is served as
``tiny-kimi`` with ``--trust-remote-code``, as SGLang serves Kimi (issue 42); the default is
unchanged. (The model itself is built and served in tests/sglang_real/test_precise_tiktoken.py.)"""
from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.sglang_cpu.cli import TIKTOKEN_MODEL_NAME, add_arguments, specs
from loadtest.sglang_cpu.server import SERVED_MODEL_NAME


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_tiktoken_flag_serves_the_kimi_form_with_trust_remote_code() -> None:
    (spec,) = specs(parse("--tokenizer", "tiktoken", "--port", "31000"))
    assert spec.served_model_name == TIKTOKEN_MODEL_NAME
    assert "--trust-remote-code" in spec.args(Path("/m"))
    (plain,) = specs(parse("--port", "31000"))
    assert plain.served_model_name == SERVED_MODEL_NAME and "--trust-remote-code" not in plain.extra_args
