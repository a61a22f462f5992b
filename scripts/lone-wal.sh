#!/usr/bin/env bash
# The WAL each lone-caller decision writes, for rate-limiter-flexible's lone caller and
# tokenlease's (direct mode, 1 task), both with `synchronous_commit = off`, on one throwaway
# server (`tokenlease loadtest --serve-db`): pg_stat_wal's bytes, full-page images and records
# over pg_stat_database's commits, read around a 4 s run of each after a CHECKPOINT. Both tables
# are warmed first by a 3 s run with 16 in flight (the peer empties its table when it starts, so
# its counted run's first touches are inserts, as in scripts/peer-compare.sh). docs/results.md
# ("The one statement's cost on the server") has the figures.
#
#   bash scripts/lone-wal.sh
#   TOKENLEASE=/path/to/tokenlease bash scripts/lone-wal.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/lib.sh
tokenlease_bin
[[ -d peers/node_modules/rate-limiter-flexible ]] || (cd peers && npm ci --no-audit --no-fund)
tmp="$(mktemp -d)"
serve_pid=
cleanup() {
    kill -TERM "$serve_pid" 2>/dev/null || true
    wait "$serve_pid" 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT
serve_db lone-wal
snap() {
    psql "$url" -X -At -v ON_ERROR_STOP=1 -c "
SELECT wal_bytes, wal_fpi, wal_records,
       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())
FROM pg_stat_wal"
}
report() { # LABEL BEFORE AFTER
    python3 - "$@" <<'PY'
import sys
a, b = ([float(x) for x in s.split("|")] for s in sys.argv[2:4])
d = [y - x for x, y in zip(a, b)]
print(f"{sys.argv[1]}: {d[3]:.0f} commits, {d[0] / d[3]:.0f} WAL bytes, "
      f"{d[1] / d[3]:.3f} full-page images, {d[2] / d[3]:.2f} records per commit")
PY
}
export PGOPTIONS="-c synchronous_commit=off"
node peers/rlf-postgres.js --url "$url" --keys 10000 --concurrency 16 --pool 16 --duration 3 >/dev/null
"$bin" loadtest --database-url "$url" --json --instances 1 --tasks 16 --duration 3 \
    --mode direct --keys 10000 --rate 1000000 >/dev/null 2>&1
psql "$url" -X -q -c CHECKPOINT
before="$(snap)"
node peers/rlf-postgres.js --url "$url" --keys 10000 --concurrency 1 --pool 1 --duration 4 >/dev/null
report "rate-limiter-flexible, 1 in flight" "$before" "$(snap)"
psql "$url" -X -q -c CHECKPOINT
before="$(snap)"
"$bin" loadtest --database-url "$url" --json --instances 1 --tasks 1 --duration 4 \
    --mode direct --keys 10000 --rate 1000000 >/dev/null 2>&1
report "tokenlease direct, 1 task" "$before" "$(snap)"
