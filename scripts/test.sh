#!/usr/bin/env bash
# The test command of the README: installs everything the tests need, then runs them.
# Idempotent: a machine that already has it all goes straight to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}

echo "== installing kvgate with its test extras"
$PY -m pip install --quiet --disable-pip-version-check -e '.[test]'

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server (apt)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ -x .ci/sglang-argcheck.sh ] || [ -f .ci/sglang-argcheck.sh ]; then
  echo "== preparing the SGLang 0.5.23 argument-parser venv (.venv-sglang)"
  bash .ci/sglang-argcheck.sh
fi

echo "== installing the peer routers (sglang-router 0.3.2, smg 1.13.0) into .venv-peers/"
bash loadtest/peers/install.sh

echo "== static checks (ruff, mypy --strict)"
$PY -m ruff check gateway policies prefix_index replicas loadtest
$PY -m mypy --strict gateway policies prefix_index replicas loadtest

echo "== running the tests"
exec $PY -m pytest "$@"
