#!/usr/bin/env bash
# Build (once per machine) a CPU-only SGLang 0.5.23 environment, used by `kvgate sglang-cpu`,
# the real-server tests (tests/sglang_real/) and the argument check (tests/deploy/).
# Facts behind every step: tools/sglang_cpu/README.md.
#
# The venv lives in a machine-level cache, not in the project, so every clone on this
# machine (CI's fresh clones included) reuses it:
#   ${KVGATE_CACHE_DIR:-$HOME/.cache/kvgate}/sglang-cpu-0.5.23-<hash of the pins>/venv
# Idempotent: the pip part is redone only when the pins change (marker .installed); the
# cheap part (torchvision patch, sgl_kernel stand-in) whenever its files change (marker
# .local). Concurrent runs are serialised with flock.
# --print-python: progress goes to stderr, and stdout gets only the venv's python path.
# --where: build nothing; print the venv's python path if it is current (exit 0), else exit 3.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
SGLANG_VERSION=0.5.23
TORCHVISION_VERSION=0.28.0
PY=${PYTHON:-python3}
QUIET=0
[[ "${1:-}" == "--print-python" ]] && QUIET=1
say() { if [[ $QUIET == 1 ]]; then echo "sglang-cpu: $*" >&2; else echo "sglang-cpu: $*"; fi; }

pins() {  # what the pip part installs
  cat "$HERE/requirements.txt" "$HERE/constraints.txt"
  echo "sglang==$SGLANG_VERSION torchvision==$TORCHVISION_VERSION"
  "$PY" -c 'import sys; print(sys.version_info[:2])'
}
local_files() { cat "$HERE/patch_torchvision.py" "$HERE"/sgl_kernel_standin/sgl_kernel/*.py; }
KEY="$(pins | sha256sum | cut -c1-12)"
LOCAL_KEY="$(local_files | sha256sum | cut -c1-12)"
CACHE="${KVGATE_CACHE_DIR:-$HOME/.cache/kvgate}"
DIR="$CACHE/sglang-cpu-$SGLANG_VERSION-$KEY"
VENV="$DIR/venv"
LOG="$DIR.install.log"

installed() { [[ -f "$DIR/.installed" && "$(cat "$DIR/.installed")" == "$KEY" && -x "$VENV/bin/python" ]]; }
current() { installed && [[ -f "$DIR/.local" && "$(cat "$DIR/.local")" == "$LOCAL_KEY" ]]; }
finish() { say "$VENV is current"; if [[ $QUIET == 1 ]]; then echo "$VENV/bin/python"; fi; exit 0; }
step() {  # step "message" command...: output into the log, shown on failure
  local t0; t0=$(date +%s); say "  $1 ..."; shift
  if ! "$@" >>"$LOG" 2>&1; then
    grep -v "^WARNING: Location" "$LOG" | tail -40 >&2; say "FAILED (full log: $LOG)"; exit 1
  fi
  say "    done in $(( $(date +%s) - t0 ))s"
}

if [[ "${1:-}" == "--where" ]]; then
  if current; then echo "$VENV/bin/python"; exit 0; fi
  echo "sglang-cpu: $VENV is not built (run bash tools/sglang_cpu/install.sh)" >&2; exit 3
fi
current && finish
mkdir -p "$CACHE"
exec 9>"$DIR.lock"
flock 9
current && finish  # another run built it while we waited

start=$(date +%s)
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --no-input)
if ! installed; then
  say "building CPU SGLang $SGLANG_VERSION in $VENV (3-4 minutes cold; log: $LOG)"
  rm -rf "$DIR"
  mkdir -p "$DIR"
  : > "$LOG"
  step "creating the venv" "$PY" -m venv "$VENV"
  step "installing CPU torch and SGLang's non-CUDA requirements (all pinned)" \
    "${PIP[@]}" -c "$HERE/constraints.txt" -r "$HERE/requirements.txt"
  step "installing sglang==$SGLANG_VERSION (--no-deps)" "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
  printf '%s' "$KEY" > "$DIR/.installed"
fi
rm -f "$DIR/.local"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
step "installing torchvision==$TORCHVISION_VERSION (--no-deps)" \
  "${PIP[@]}" --no-deps --force-reinstall "torchvision==$TORCHVISION_VERSION"
step "patching torchvision's fake-kernel registrations" "$VENV/bin/python" "$HERE/patch_torchvision.py" "$SITE"
rm -rf "$SITE/sgl_kernel"
step "installing the sgl_kernel stand-in" cp -r "$HERE/sgl_kernel_standin/sgl_kernel" "$SITE/"
step "checking that sglang's CPU server imports" env SGLANG_USE_CPU_ENGINE=1 \
  "$VENV/bin/python" -c "import torchvision, sgl_kernel, sglang.srt.entrypoints.http_server"
printf '%s' "$LOCAL_KEY" > "$DIR/.local"
say "built $VENV in $(( $(date +%s) - start ))s, $(du -sh "$VENV" | cut -f1)"
finish
