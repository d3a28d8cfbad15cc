#!/usr/bin/env bash
# The fast tier for the edit-test loop: unit and property tests that start no process
# (no gateway, replica, redis-server or SGLang), under a minute on a 2-core machine.
# It installs nothing: run `bash scripts/test.sh` once first. The full suite
# (`bash scripts/test.sh`, what CI runs) still runs every one of these tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# files below the unit folders that start a server or a process of their own
SLOW=(
  tests/gateway/test_index_write_behind.py tests/gateway/test_server_tick.py tests/kv_events/test_event_lease.py tests/kv_events/test_sim_precise.py
  tests/prefix_index/test_redis_specific.py tests/replicas/test_admission_trust.py
  tests/replicas/test_shared_state.py
)
ignores=()
for f in "${SLOW[@]}"; do ignores+=(--ignore "$f"); done
exec $PY -m pytest -q -p no:cacheprovider "${ignores[@]}" \
  -m "not slow and not redis and not peers and not sglang_real and not safety" \
  tests/test_imports.py tests/test_public_apis.py tests/policies tests/prefix_index tests/gateway tests/replicas tests/kv_events \
  tests/api/test_units.py "$@"
