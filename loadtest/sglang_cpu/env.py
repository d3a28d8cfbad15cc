"""Where the real CPU SGLang environment and the tiny model live, and building them.

Both are cached per machine, outside the project, so every clone (CI's fresh ones
included) reuses them: ``${KVGATE_CACHE_DIR:-~/.cache/kvgate}/sglang-cpu-0.5.23-<pins>/``
holds ``venv/`` (built by ``tools/sglang_cpu/install.sh``) and
``models/tiny-llama-<hash of model.py>/`` (built by :mod:`.model` inside that venv), and,
when asked for, ``models/tiny-kimi-<hash>/``: the same model with its tokenizer in Kimi K2's
TikToken form (built by :mod:`.kimi_model`, served with ``--trust-remote-code``).
Each build runs at most once per key; a progress message goes to stderr first.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "tools" / "sglang_cpu" / "install.sh"
MODEL_BUILDER = Path(__file__).resolve().with_name("model.py")
TIKTOKEN_BUILDER = Path(__file__).resolve().with_name("kimi_model.py")
TIKTOKEN_CLASS = Path(__file__).resolve().with_name("tokenization_kimi.py")
TIKTOKEN_TOOLS = Path(__file__).resolve().parents[2] / "gateway" / "kimi_tools.py"  # its tool_declaration_ts.py
INSTALL_TIMEOUT_S = 1800.0
MODEL_TIMEOUT_S = 600.0


class EnvError(RuntimeError):
    """The SGLang CPU environment or the tiny model could not be built."""


@dataclass(frozen=True, slots=True)
class SGLangEnv:
    python: Path  # the venv's interpreter
    model_dir: Path  # the tiny model served by default


def cache_dir() -> Path:
    return Path(os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate")


def ensure_venv() -> Path:
    """Run the (idempotent) installer; returns the venv's python."""
    if not INSTALLER.is_file():
        raise EnvError(f"{INSTALLER} not found (kvgate sglang-cpu needs a source checkout)")
    try:
        done = subprocess.run(["bash", str(INSTALLER), "--print-python"], stdout=subprocess.PIPE,
                              text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise EnvError(f"{INSTALLER} did not finish in {INSTALL_TIMEOUT_S:.0f}s") from e
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise EnvError(f"{INSTALLER} failed with exit code {done.returncode}")
    return Path(lines[-1])


def model_key() -> str:
    return hashlib.sha256(MODEL_BUILDER.read_bytes()).hexdigest()[:12]


def model_dir_for(python: Path) -> Path:
    """``<venv's parent>/models/tiny-llama-<hash of model.py>``."""
    return python.parent.parent.parent / "models" / f"tiny-llama-{model_key()}"


def tiktoken_model_dir_for(python: Path) -> Path:
    """``<venv's parent>/models/tiny-kimi-<hash of its builder, model.py, the tokenizer class and
    the tool declaration>``."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (TIKTOKEN_BUILDER, MODEL_BUILDER, TIKTOKEN_CLASS,
                                                            TIKTOKEN_TOOLS)))
    return python.parent.parent.parent / "models" / f"tiny-kimi-{key.hexdigest()[:12]}"


def ensure_model(python: Path) -> Path:
    """Build the tiny model with the venv's ``python`` unless it is cached."""
    return _build(python, MODEL_BUILDER, model_dir_for(python), "the tiny model")


def ensure_tiktoken_model(python: Path) -> Path:
    """Build the tiny TikToken-form (Kimi K2 layout) model unless it is cached."""
    return _build(python, TIKTOKEN_BUILDER, tiktoken_model_dir_for(python), "the tiny TikToken-form model")


def _build(python: Path, builder: Path, out: Path, what: str) -> Path:
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    print(f"sglang-cpu: building {what} in {out} (about 20 s)", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([str(python), str(builder), "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=MODEL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise EnvError(f"model builder did not finish in {MODEL_TIMEOUT_S:.0f}s") from e
    if done.returncode != 0:
        raise EnvError(f"model builder failed with exit code {done.returncode}:\n{done.stdout[-3000:]}")
    return out


def ensure_env() -> SGLangEnv:
    python = ensure_venv()
    return SGLangEnv(python=python, model_dir=ensure_model(python))


def main() -> int:
    """``python -m loadtest.sglang_cpu.env``: build what is missing, print where it is."""
    try:
        env = ensure_env()
    except EnvError as e:
        print(f"sglang-cpu: {e}", file=sys.stderr)
        return 1
    print(f"sglang-cpu: python {env.python}\nsglang-cpu: model {env.model_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
