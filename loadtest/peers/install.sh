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

install_peer() {  # name package version
    local name="$1" package="$2" version="$3" venv="$PEERS/$1"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip show "$package" 2>/dev/null \
            | grep -qx "Version: $version"; then
        echo "peers: $name already has $package==$version ($venv)"
        return 0
    fi
    echo "peers: installing $package==$version into $venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$package==$version"
    "$venv/bin/python" -m pip show "$package" | grep -x "Version: $version" >/dev/null
    echo "peers: $name ready"
}

mkdir -p "$PEERS"
install_peer sglang-router sglang-router 0.3.2
install_peer smg smg 1.13.0
