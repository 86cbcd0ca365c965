#!/usr/bin/env bash
# Build (once) the contract environment for tests/contract and print its path on stdout.
#
#   venv=$(scripts/contract-env.sh) && DYNSPEC_REQUIRE_CONTRACT=1 "$venv/bin/python" -m pytest -q tests/contract
#
# SGLang 0.5.23 on CPU with its own pins (requirements/contract.txt): torch==2.14.1 with its
# dependencies (~6 GB, mostly nvidia-* libraries), then everything else with --no-deps. The
# venv lives outside the clone, keyed by a hash of the pinned list and the Python version, so
# repeated runs (and other clones) reuse it; a changed list builds a new one. Our package is
# (re)installed editable from THIS clone on every run, so the entry point
# `sglang.srt.plugins: dynspec = tuner.plugin:register` points here.
#
# Env: DYNSPEC_CONTRACT_CACHE (default ~/.cache/dynspec-tuner), DYNSPEC_CONTRACT_PYTHON
# (default python3.11). Progress goes to stderr.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
req="$repo/requirements/contract.txt"
py=${DYNSPEC_CONTRACT_PYTHON:-python3.11}
cache=${DYNSPEC_CONTRACT_CACHE:-$HOME/.cache/dynspec-tuner}

log() { printf 'contract-env: %s\n' "$*" >&2; }

pyver=$("$py" -c 'import sys; print(sys.version.split()[0])')
# The recipe version (v1) is part of the key: changing how the venv is built rebuilds it.
key=$( { echo "recipe v1"; echo "python $pyver"; cat "$req"; } | sha256sum | cut -c1-16)
venv="$cache/contract-$key"
mkdir -p "$cache"

# One builder at a time per cache (two CI runs or a developer and CI on one machine).
exec 9>"$cache/.contract-$key.lock"
flock 9

if [ ! -f "$venv/.complete" ]; then
    # A venv without the marker is a build that was interrupted: start over.
    rm -rf "$venv"
    log "building $venv (python $pyver; torch with its dependencies is about 6 GB) ..."
    start=$(date +%s)
    "$py" -m venv "$venv"
    pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
    # Stage 1: torch WITH its dependencies, each held to the version pinned in the list.
    torch_pin=$(grep -E '^torch==' "$req")
    "${pip[@]}" install -c "$req" "$torch_pin" >&2
    # Stage 2: the whole list without dependency resolution (SGLang's pins are ours).
    "${pip[@]}" install --no-deps -r "$req" >&2
    # What pip installed must be exactly the list (a wrong pin or a stray upgrade fails here).
    "$venv/bin/python" - "$req" >&2 <<'PY'
import re, sys
from importlib.metadata import distributions

want = {}
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = line.split("==")
        want[re.sub(r"[-_.]+", "-", name).lower()] = version
have = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in distributions()}
wrong = {n: (v, have.get(n)) for n, v in want.items() if have.get(n) != v}
if wrong:
    sys.exit(f"contract-env: installed versions differ from the pins: {wrong}")
PY
    touch "$venv/.complete"
    log "built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
fi

# Our package from this clone, without touching the pinned dependencies.
"$venv/bin/python" -m pip --disable-pip-version-check --quiet install --no-deps \
    --no-build-isolation -e "$repo" >&2
echo "$venv"
