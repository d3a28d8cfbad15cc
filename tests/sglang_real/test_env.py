"""The CPU SGLang environment and the tiny model: the installer's marker, the model folder
(offline AutoTokenizer, chat template, config), the sgl_kernel stand-in, the torchvision
patch, and the launch arguments of ``kvgate sglang-cpu``.

Tests that need the venv run their checks in it (a subprocess); the others are plain.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from loadtest.sglang_cpu import cli
from loadtest.sglang_cpu.env import INSTALLER, SGLangEnv
from loadtest.sglang_cpu.server import OFFLINE_ENV, ServerSpec, server_env

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name: str) -> Any:
    """A script of tools/sglang_cpu/ as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "sglang_cpu" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


patch_torchvision = load_tool("patch_torchvision")

MODEL_CHECK = r"""
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, pages!"}]
text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
print(json.dumps({"text": text, "n": len(ids), "vocab": len(tok), "eos": tok.eos_token}))
"""
STANDIN_CHECK = r"""
import torch, sgl_kernel
req_to_token = torch.zeros((3, 8), dtype=torch.int32)
sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]),
                                        torch.tensor([3, 2]), torch.tensor([7, 8, 9, 10]), 8)
assert req_to_token[2].tolist() == [0, 7, 8, 0, 0, 0, 0, 0], req_to_token
assert req_to_token[0].tolist() == [9, 10, 0, 0, 0, 0, 0, 0], req_to_token
try:
    sgl_kernel.some_cuda_kernel()
except NotImplementedError:
    print("ok")
"""


def run_in_venv(env: SGLangEnv, code: str, *args: str) -> str:
    done = subprocess.run([str(env.python), "-c", code, *args], capture_output=True, text=True,
                          env=server_env(), timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.sglang_real
def test_installer_is_current_and_idempotent(sglang_env: SGLangEnv) -> None:
    where = subprocess.run(["bash", str(INSTALLER), "--where"], capture_output=True, text=True,
                           timeout=60, check=True)
    assert Path(where.stdout.strip()) == sglang_env.python
    again = subprocess.run(["bash", str(INSTALLER)], capture_output=True, text=True, timeout=60, check=True)
    assert "is current" in again.stdout


@pytest.mark.sglang_real
def test_tiny_model_folder(sglang_env: SGLangEnv) -> None:
    config = json.loads((sglang_env.model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (2, 64, 4, 2, 128)
    assert "chat_template" in json.loads((sglang_env.model_dir / "tokenizer_config.json").read_text())
    assert (sglang_env.model_dir / "model.safetensors").is_file()
    out = json.loads(run_in_venv(sglang_env, MODEL_CHECK, str(sglang_env.model_dir)))
    assert out["text"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, pages!"
                           "<|im_end|>\n<|im_start|>assistant\n")
    assert out["vocab"] == 4096 and out["eos"] == "<|im_end|>" and 10 < out["n"] < 40


@pytest.mark.sglang_real
def test_sgl_kernel_standin(sglang_env: SGLangEnv) -> None:
    assert run_in_venv(sglang_env, STANDIN_CHECK) == "ok"


ORIGINAL = '''import torch
import torch._custom_ops
import torch.library

import torchvision.extension  # noqa: F401


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    pass


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    pass
'''


def test_torchvision_patch_is_idempotent() -> None:
    once = patch_torchvision.patch(ORIGINAL)
    assert "@torch.library.register_fake" not in once
    assert once.count('@_kvgate_fake("torchvision::') == 2
    assert patch_torchvision.patch(once) == once
    compile(once, "_meta_registrations.py", "exec")
    with pytest.raises(ValueError):
        patch_torchvision.patch("import torch\n")


def test_cli_specs_and_flags() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--replicas", "2", "--base-port", "31000", "--page-size", "16",
                              "--kv-events-endpoint", "tcp://127.0.0.1:5557",
                              "--kv-events-replay-endpoint", "tcp://127.0.0.1:5600"])
    specs = cli.specs(args)
    assert [s.port for s in specs] == [31000, 31001]
    assert [s.kv_events_endpoint for s in specs] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    argv = specs[1].args(Path("/m"))
    pairs = dict(zip(argv[::2], argv[1::2], strict=False))
    assert pairs["--host"] == "127.0.0.1" and pairs["--page-size"] == "16"
    kv_config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert kv_config["endpoint"] == "tcp://127.0.0.1:5558" and kv_config["replay_endpoint"] == "tcp://127.0.0.1:5601"
    for flag in ("--sleep-on-idle", "--enable-cache-report", "--enable-metrics", "--disable-cuda-graph"):
        assert flag in argv
    assert ServerSpec(port=1).args(Path("/m")).count("--page-size") == 0
    env = server_env({"PATH": "/bin", "PYTHONPATH": "/x"})
    assert "PYTHONPATH" not in env and all(env[k] == v for k, v in OFFLINE_ENV.items())
