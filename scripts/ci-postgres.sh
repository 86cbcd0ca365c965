#!/usr/bin/env bash
# Start a throwaway PostgreSQL on loopback for the storage tests and print its URL.
# Usage: eval "$(scripts/ci-postgres.sh)"   -> exports DYNSPEC_TEST_POSTGRES_URL
set -euo pipefail
PORT="${DYNSPEC_PG_PORT:-54329}"
if ! ls -d /usr/lib/postgresql/*/bin >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2
fi
BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
DATA=$(mktemp -d /tmp/dynspec-pg.XXXXXX)
chown postgres "$DATA"
as_pg() { runuser -u postgres -- "$@"; }
as_pg "$BIN/initdb" -D "$DATA" -A trust -U postgres >/dev/null
as_pg "$BIN/pg_ctl" -D "$DATA" -l "$DATA/server.log" -w \
  -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DATA -c fsync=off" start >&2
as_pg "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres dynspec_test
echo "export DYNSPEC_TEST_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:$PORT/dynspec_test"
echo "export DYNSPEC_PG_DATA=$DATA"
