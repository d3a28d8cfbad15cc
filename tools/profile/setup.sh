#!/usr/bin/env bash
# Idempotent: a venv beside the project (.venv-tools/) holding py-spy, the sampling profiler
# tools/profile/profile_serve.py attaches to a running `kvgate serve`.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/.venv-tools"
if [ ! -x "$venv/bin/py-spy" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet py-spy
fi
"$venv/bin/py-spy" --version
