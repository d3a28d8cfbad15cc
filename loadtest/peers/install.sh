#!/usr/bin/env bash
# Install the peer routers used as baselines, each into its own virtual environment:
#   .venv-peers/sglang-router  (sglang-router==0.3.2, python -m sglang_router.launch_router)
#   .venv-peers/smg            (smg==1.13.0, smg launch / python -m smg.launch_router)
# They are separate programs, not project dependencies. Idempotent: an environment that
# already has the pinned version is left alone. Usage: bash loadtest/peers/install.sh [ROOT]
set -euo pipefail

ROOT="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
PEERS="$ROOT/.venv-peers"
PYTHON="${PYTHON:-python3}"

# shellcheck source=../../tools/bench/pinned_venv.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tools/bench/pinned_venv.sh"

mkdir -p "$PEERS"
install_pinned peers "$PEERS/sglang-router" sglang-router 0.3.2 "$PYTHON"
install_pinned peers "$PEERS/smg" smg 1.13.0 "$PYTHON"
