#!/usr/bin/env bash
# A/B of candidate one-key statements by the PostgreSQL server's CPU per transaction, on ONE
# throwaway server: each candidate runs under pgbench (`-M prepared`, $CLIENTS clients, 1 by
# default: a lone caller) for $PHASE_S seconds, the candidates alternating for $ROUNDS rounds,
# and the script prints each candidate's server CPU µs per transaction (every round, and the
# median) with its transactions per second. The server CPU is read from /proc for the whole
# cluster (postmaster, backends, background processes, exited ones included), as
# scripts/peer-compare.sh does.
#
#   bash scripts/statement-cpu.sh A.sql B.sql ...
#   PHASE_S=5 ROUNDS=5 CLIENTS=1 bash scripts/statement-cpu.sh A.sql B.sql
#   TOKENLEASE=/path/to/tokenlease bash scripts/statement-cpu.sh ...   # a prebuilt binary
#   SYNC_COMMIT=off bash scripts/statement-cpu.sh ...   # pgbench's sessions do not wait for
#       the WAL flush: on a machine whose disk is busy (other builds) the commit's wait and
#       the background processes' share per transaction vary less; the statement's own work is
#       the same
#
# A candidate is one SQL statement with the one-key take's parameters (`tokenlease loadtest
# --print-statement one` prints the store's; `-` as a file name stands for it): $1 the key, $2
# capacity, $3 rate, $4 min, $5 want, $6 step. They are replaced as peer-compare.sh does (a
# random key of $KEYS, capacity 100 tokens, 50 tokens/s, take exactly 1 token, all in
# nanotokens). Before the first round the table is filled with a full bucket for every key, so
# each transaction updates an existing row, as in a steady state. The server is started by
# `tokenlease loadtest --serve-db` (migrated, removed at the end); with DATABASE_URL set, that
# server is used instead (its postmaster must be on this machine for the CPU figures).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PHASE_S="${PHASE_S:-5}"
ROUNDS="${ROUNDS:-3}"
CLIENTS="${CLIENTS:-1}"
SYNC_COMMIT="${SYNC_COMMIT:-on}"
KEYS="${KEYS:-10000}"
[[ $# -ge 1 ]] || { echo "usage: $0 A.sql [B.sql ...]" >&2; exit 2; }
for tool in pgbench psql python3; do
    command -v "$tool" >/dev/null || { echo "statement-cpu: $tool is not on PATH" >&2; exit 1; }
done
source scripts/lib.sh
tokenlease_bin
tmp="$(mktemp -d)"
serve_pid=
cleanup() {
    if [[ -n "$serve_pid" ]]; then
        kill -TERM "$serve_pid" 2>/dev/null || true
        wait "$serve_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
if [[ -n "${DATABASE_URL:-}" ]]; then
    url="$DATABASE_URL"
else
    serve_db statement-cpu
fi
[[ -n "$url" ]] || { echo "statement-cpu: no server" >&2; exit 1; }

# The postmaster: the parent of the backend that answers pg_backend_pid() (as peer-compare.sh).
postmaster="$(psql "$url" -X -q -At -v ON_ERROR_STOP=1 2>/dev/null <<'SQL' || true
SELECT pg_backend_pid() AS backend_pid \gset
\setenv STATEMENT_CPU_BACKEND :backend_pid
\! ppid=$(awk '/^PPid:/ { print $2 }' "/proc/$STATEMENT_CPU_BACKEND/status" 2>/dev/null); comm=$(cat "/proc/$ppid/comm" 2>/dev/null); { [ "$comm" = postgres ] || [ "$comm" = postmaster ]; } && echo "$ppid"
SQL
)"
[[ -n "$postmaster" ]] || { echo "statement-cpu: the server's postmaster is not on this machine" >&2; exit 1; }
# The cluster's CPU seconds so far (the same reading as peer-compare.sh's cluster_cpu).
cat >"$tmp/cluster_cpu.py" <<'PY'
import os, sys

def stat(pid):
    try:
        line = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    f = line[line.rindex(")") + 2:].split()
    ppid, times = int(f[1]), [int(x) for x in f[11:15]]
    return ppid, sum(times), times[2] + times[3], f[0] in ("Z", "X")

postmaster = int(sys.argv[1])
for attempt in range(5):
    before = stat(postmaster)
    children = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = stat(name)
            if s is not None and s[0] == postmaster:
                children += s[1]
    after = stat(postmaster)
    if after[2] == before[2]:
        break
print((after[1] + children) / os.sysconf("SC_CLK_TCK"))
PY

# Every key as a full bucket.
psql "$url" -X -q -v ON_ERROR_STOP=1 -c "
INSERT INTO tokenlease_buckets (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
SELECT 'pgbench:' || i, 100000000000, 0, 100000000000, 50000000000,
       (extract(epoch FROM now()) * 1000000)::bigint, 100000000000
FROM generate_series(1, $KEYS) AS i
ON CONFLICT (key) DO NOTHING" >/dev/null

names=()
n=0
for file in "$@"; do
    if [[ "$file" == - ]]; then
        "$bin" loadtest --print-statement one >"$tmp/store.sql"
        file="$tmp/store.sql"
        names+=("the store's one-key take (lean.rs)")
    else
        names+=("$file")
    fi
    {
        echo "\\set key random(1, $KEYS)"
        grep -v '^[[:space:]]*--' "$file" | sed -e 's/;[[:space:]]*$//' \
            -e "s/\\\$1/('pgbench:' || :key::text)/g" \
            -e "s/\\\$2/100000000000::bigint/g" \
            -e "s/\\\$3/50000000000::bigint/g" \
            -e "s/\\\$[456]/1000000000::bigint/g"
        echo ';'
    } >"$tmp/c$n.pgbench"
    if grep -q '\$[0-9]' "$tmp/c$n.pgbench"; then
        echo "statement-cpu: $file has parameters this script does not replace" >&2
        exit 1
    fi
    n=$((n + 1))
done

: >"$tmp/results"
for round in $(seq 1 "$ROUNDS"); do
    for i in $(seq 0 $((n - 1))); do
        start="$(python3 "$tmp/cluster_cpu.py" "$postmaster")"
        (cd "$tmp" && PGOPTIONS="-c synchronous_commit=$SYNC_COMMIT" pgbench -n -M prepared -c "$CLIENTS" -j "$CLIENTS" -T "$PHASE_S" \
            -f "c$i.pgbench" "$url" >pgbench.out 2>pgbench.err) || {
            cat "$tmp/pgbench.err" >&2
            exit 1
        }
        end="$(python3 "$tmp/cluster_cpu.py" "$postmaster")"
        txns="$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$tmp/pgbench.out")"
        fails="$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$tmp/pgbench.out")"
        echo "$i $round $start $end $txns ${fails:-0}" >>"$tmp/results"
        python3 - "$round" "${names[$i]}" "$start" "$end" "$txns" "$PHASE_S" "${fails:-0}" <<'PY'
import sys
rnd, name, s, e, t, phase, fails = sys.argv[1:]
print(f"round {rnd}  {name}: {(float(e) - float(s)) * 1e6 / int(t):.1f} µs server CPU per "
      f"transaction, {int(t) / float(phase):,.0f} tps, {fails} failed", file=sys.stderr)
PY
    done
done

python3 - "$tmp/results" "$PHASE_S" "${names[@]}" <<'PY'
import statistics, sys
path, phase, names = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
rows = {}
for line in open(path):
    i, rnd, s, e, t, f = line.split()
    rows.setdefault(int(i), []).append(((float(e) - float(s)) * 1e6 / int(t), int(t) / phase))
print("| candidate | server CPU µs/transaction, each round | median | least | tps (median) |")
print("|---|---|---|---|---|")
for i, name in enumerate(names):
    us = [u for u, _ in rows[i]]
    tps = [x for _, x in rows[i]]
    print(f"| {name} | {', '.join(f'{u:.1f}' for u in us)} | {statistics.median(us):.1f} | "
          f"{min(us):.1f} | {statistics.median(tps):,.0f} |")
PY
