#!/usr/bin/env bash
# Install the third-party benchmark clients run against kvgate, each into its own venv:
#   $BENCH/aiperf          (aiperf==0.13.0: `aiperf profile ...`, multi-turn sessions)
#   $BENCH/inference-perf  (inference-perf==0.7.0: `inference-perf --config_file ...`;
#                           it requires Python >= 3.12: $PYTHON312, default python3.12)
#   $BENCH/guidellm        (guidellm==0.8.1: `guidellm run ...`, 0.8's name for `benchmark`;
#                           Python >= 3.10. It depends on torch, pinned to 2.13.0: pip takes
#                           the CPU wheel on its find-links where the machine has one (1.5 GB
#                           venv), else the index's CUDA build, several GB)
# $BENCH is ${KVGATE_CACHE_DIR:-~/.cache/kvgate}/bench: built once per machine (~5 minutes
# cold), shared by every checkout, as the CPU SGLang environment is.
# They are separate programs, not project dependencies (docs/results-sglang-cpu.md says
# how they are run). Idempotent: an environment that already has the pinned version is
# left alone. Usage: bash tools/bench/install.sh [BENCH_DIR]
set -euo pipefail

BENCH="${1:-${KVGATE_CACHE_DIR:-$HOME/.cache/kvgate}/bench}"
PYTHON="${PYTHON:-python3}"

find_python312() {  # $PYTHON312, a working python3.12 on PATH, or pyenv's 3.12
    local candidate
    for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "bench: inference-perf needs Python >= 3.12 (set PYTHON312)" >&2
    return 1
}

# shellcheck source=pinned_venv.sh
. "$(dirname "${BASH_SOURCE[0]}")/pinned_venv.sh"

mkdir -p "$BENCH"
install_pinned bench "$BENCH/aiperf" aiperf 0.13.0 "$PYTHON"
install_pinned bench "$BENCH/inference-perf" inference-perf 0.7.0 "$(find_python312)"
install_pinned bench "$BENCH/guidellm" guidellm 0.8.1 "$PYTHON" torch==2.13.0
