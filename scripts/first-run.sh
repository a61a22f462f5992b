#!/usr/bin/env bash
# The first direct-mode loadtest on a freshly migrated table against the runs after it on the
# same server, the table then full of rows: whether the store's statements keep their cost
# while the table grows under sessions that planned them on an empty table
# (docs/design/statements.md, "Plans that hold at any table size"). One throwaway cluster (`tokenlease loadtest --serve-db`), then $RUNS runs of `tokenlease
# loadtest --mode direct --keys $KEYS --duration $DURATION` against it, each a new process with
# new sessions. After each run it prints the run's figures and what the server knew of the
# table: its rows, sequential and index scans so far, and when autovacuum last analysed it
# (which would replan the sessions' statements).
#
#   bash scripts/first-run.sh                       # RUNS=4 KEYS=100000 DURATION=10
#   TOKENLEASE=/path/to/tokenlease RUNS=3 bash scripts/first-run.sh
#   EXTRA="--statements-in-flight 4" bash scripts/first-run.sh   # more loadtest options
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNS="${RUNS:-4}"
KEYS="${KEYS:-100000}"
DURATION="${DURATION:-10}"
source scripts/lib.sh
tokenlease_bin
tmp="$(mktemp -d)"
cleanup() {
    [[ -n "${serve_pid:-}" ]] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
serve_db first-run

echo "| run | server CPU µs/decision | decisions/s | p99 µs | fallback decisions | rows | seq scans | index scans | last autoanalyze |"
echo "|---|---|---|---|---|---|---|---|---|"
for run in $(seq 1 "$RUNS"); do
    # shellcheck disable=SC2086 # EXTRA is a list of options
    "$bin" loadtest --database-url "$url" --mode direct --keys "$KEYS" --duration "$DURATION" \
        ${EXTRA:-} --json >"$tmp/run.json" 2>"$tmp/run.log" || {
        cat "$tmp/run.log" >&2
        exit 1
    }
    # Let the loadtest's sessions end, so their statistics are flushed (at backend exit).
    sleep 1 # sleep: a script between runs, not a test
    stats="$(psql "$url" -X -At -F ' | ' -c "SELECT pg_stat_clear_snapshot();" -c "
        SELECT c.reltuples::bigint, s.seq_scan, s.idx_scan,
               coalesce(to_char(s.last_autoanalyze, 'HH24:MI:SS'), 'never')
        FROM pg_class AS c JOIN pg_stat_user_tables AS s ON s.relid = c.oid
        WHERE c.oid = 'tokenlease_buckets'::regclass" | tail -n 1)"
    python3 - "$tmp/run.json" "$run" "$stats" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
cpu = r.get("server_cpu_us_per_decision")
print(f"| {sys.argv[2]} | {cpu:.1f} | {r['throughput_per_s']:.0f} | {r['p99_us']:.0f} | "
      f"{r['fallback_decisions']} | {sys.argv[3]} |" if cpu is not None else
      f"| {sys.argv[2]} | n/a | {r['throughput_per_s']:.0f} | {r['p99_us']:.0f} | "
      f"{r['fallback_decisions']} | {sys.argv[3]} |")
PY
done
