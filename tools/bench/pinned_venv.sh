# Sourced by tools/bench/install.sh and loadtest/peers/install.sh: one pinned package per
# virtual environment, idempotent.
#   install_pinned LABEL VENV PACKAGE VERSION PYTHON [REQUIREMENT...]
# leaves VENV alone when it already has PACKAGE==VERSION, else (re)creates it with PYTHON
# and installs the pin, with any further REQUIREMENTs in the same resolve (guidellm's
# torch, say, pinned so that pip takes the CPU build on this machine's disk).
install_pinned() {
    local label="$1" venv="$2" package="$3" version="$4" python="$5"
    shift 5
    # no `grep -q`: with pipefail, pip would die of SIGPIPE and the check would fail
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip show "$package" 2>/dev/null \
            | grep -x "Version: $version" >/dev/null; then
        echo "$label: $(basename "$venv") already has $package==$version ($venv)"
        return 0
    fi
    echo "$label: installing $package==$version${*:+ with $*} into $venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$package==$version" "$@"
    "$venv/bin/python" -m pip show "$package" | grep -x "Version: $version" >/dev/null
    echo "$label: $(basename "$venv") ready"
}
