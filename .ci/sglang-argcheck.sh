#!/usr/bin/env bash
# Make sure SGLang 0.5.23's own argument parser runs on this machine, for
# tests/deploy/test_sglang_args.py (docs: tools/sglang_argcheck/README.md). It uses the
# CPU SGLang venv of tools/sglang_cpu/install.sh (one environment for the argument check
# and the real CPU servers, cached per machine in ~/.cache/kvgate); idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN="$(bash tools/sglang_cpu/install.sh --print-python)"
"$PYBIN" tools/sglang_argcheck/check.py --selftest >/dev/null
echo "sglang-argcheck: SGLang 0.5.23's parser runs in $PYBIN"
