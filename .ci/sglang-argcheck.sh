#!/usr/bin/env bash
# Create .venv-sglang: a separate venv where SGLang 0.5.23's own argument parser imports
# on CPU, used by tests/deploy/test_sglang_args.py to validate the generated launch
# command (docs: tools/sglang_argcheck/README.md). Idempotent: a venv whose marker
# matches the requirements is kept as is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sglang
REQ=tools/sglang_argcheck/requirements.txt
CON=tools/sglang_argcheck/constraints.txt
SGLANG_VERSION=0.5.23
MARKER="$VENV/.kvgate-argcheck"
want="$(cat "$REQ" "$CON"; echo "sglang==$SGLANG_VERSION")"
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$want" ]] \
    && "$VENV/bin/python" tools/sglang_argcheck/check.py --selftest >/dev/null 2>&1; then
  echo "sglang-argcheck: $VENV is current"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
"${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check -c "$CON" -r "$REQ"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "sglang==$SGLANG_VERSION"
printf '%s' "$want" > "$MARKER"
"$VENV/bin/python" tools/sglang_argcheck/check.py --selftest >/dev/null
echo "sglang-argcheck: built $VENV in $(( $(date +%s) - start ))s, $(du -sh "$VENV" | cut -f1)"
