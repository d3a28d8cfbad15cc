#!/usr/bin/env bash
# The test command of the README: installs everything the tests need, then runs them.
# Idempotent: a machine that already has it all goes straight to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}

echo "== installing kvgate with its test and bench extras"
$PY -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server (apt)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# The real SGLang 0.5.23 CPU environment and the tiny model (tools/sglang_cpu/install.sh,
# loadtest/sglang_cpu/model.py), shared by tests/deploy (SGLang's argument parser) and
# tests/sglang_real (real servers): built once per machine in ${KVGATE_CACHE_DIR:-~/.cache/kvgate}
# (about 4 minutes cold, seconds when current). The sglang_real tests FAIL without it; a
# quick local run may deselect them: bash scripts/test.sh -m "not sglang_real"
echo "== preparing CPU SGLang 0.5.23 and the tiny model (cached per machine)"
start=$(date +%s)
bash .ci/sglang-argcheck.sh
$PY -m loadtest.sglang_cpu.env
echo "   ready in $(( $(date +%s) - start ))s"

echo "== installing promtool and helm (deploy tests: rules and the Helm chart)"
bash tools/ops/install.sh

echo "== installing the peer routers (sglang-router 0.3.2, smg 1.13.0) into .venv-peers/"
bash loadtest/peers/install.sh

echo "== installing aiperf, inference-perf and guidellm (cached per machine; tests/loadtest/test_bench_tools.py)"
bash tools/bench/install.sh

echo "== static checks (ruff, mypy --strict)"
$PY -m ruff check gateway policies prefix_index replicas loadtest
$PY -m mypy --strict gateway policies prefix_index replicas loadtest

echo "== running the tests"
exec $PY -m pytest "$@"
