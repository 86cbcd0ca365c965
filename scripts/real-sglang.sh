#!/usr/bin/env bash
# The real-server tier: SGLang 0.5.23's own server on CPU with our plugin, the daemon against it.
#
#   scripts/real-sglang.sh [pytest args]   # e.g. -s to see the figures, or tests/real/test_x.py
#
# Builds what it needs, cached outside the clone:
#   1. the contract environment (scripts/contract-env.sh: SGLang 0.5.23, torch, ~6 GB);
#   2. the server-path extras of requirements/real-sglang.txt, installed --no-deps into
#      <cache>/real-extras-<hash> and put on PYTHONPATH in front of that venv (no second torch);
#   3. the project's own venv (.venv, as the README installs it) if it is missing: the daemon,
#      sweep and report run from there, as they would beside a production server.
# Then runs tests/real with DYNSPEC_REQUIRE_REAL=1: any failure or skip fails the script.
#
# Env: DYNSPEC_CONTRACT_CACHE / DYNSPEC_CONTRACT_PYTHON as for contract-env.sh;
# DYNSPEC_RESULTS_DIR: where the tier writes its figures (JSON), by default a temporary folder
# named at the end of the run; the checkout is left as it was.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
req="$repo/requirements/real-sglang.txt"
cache=${DYNSPEC_CONTRACT_CACHE:-$HOME/.cache/dynspec-tuner}

log() { printf 'real-sglang: %s\n' "$*" >&2; }

venv=$("$repo/scripts/contract-env.sh")
pyver=$("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])')
key=$( { echo "recipe v1"; echo "python $pyver"; echo "venv $venv"; cat "$req"; } \
       | sha256sum | cut -c1-16)
extras="$cache/real-extras-$key"

exec 8>"$cache/.real-extras-$key.lock"
flock 8
if [ ! -f "$extras/.complete" ]; then
    rm -rf "$extras"
    log "installing $req into $extras ..."
    "$venv/bin/python" -m pip --disable-pip-version-check --quiet install --no-deps \
        --target "$extras" -r "$req" >&2
    touch "$extras/.complete"
fi
flock -u 8

if [ ! -x "$repo/.venv/bin/dynspec-tuner" ]; then
    log "building the project venv (.venv) for the daemon, sweep and report ..."
    python3.11 -m venv "$repo/.venv"
    "$repo/.venv/bin/pip" --disable-pip-version-check --quiet install -e "$repo[test]" >&2
fi

cd "$repo"
# Arguments that name test files replace the folder; options alone add to it.
targets=(tests/real)
for arg in "$@"; do
    case "$arg" in tests/*) targets=() ;; esac
done
start=$(date +%s)
status=0
PYTHONPATH="$extras${PYTHONPATH:+:$PYTHONPATH}" DYNSPEC_REQUIRE_REAL=1 \
    DYNSPEC_REAL_CLIENT="$repo/.venv/bin/dynspec-tuner" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "${targets[@]}" "$@" || status=$?
log "tier finished in $(( $(date +%s) - start )) s (exit $status)"
exit "$status"
