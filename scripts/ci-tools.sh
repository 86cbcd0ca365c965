#!/usr/bin/env bash
# Install the tools tests/test_deploy.py runs: promtool (Debian's prometheus package) and
# systemd-analyze (Debian's systemd). One apt-get update, and only when one is missing.
set -euo pipefail
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
promtool --version 2>&1 | head -n 1
systemd-analyze --version | head -n 1
