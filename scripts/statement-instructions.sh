#!/usr/bin/env bash
# Instructions the PostgreSQL server executes per run of candidate one-key statements, counted
# by valgrind (callgrind) in a single-user backend: deterministic, where CPU time on a shared
# 2-core machine varies by tens of percent from run to run (scripts/statement-cpu.sh measures
# that). docs/design/statements.md has the figures this produced.
#
#   bash scripts/statement-instructions.sh A.sql B.sql ...   # `-`: the store's one-key take
#   N=500 KEYS=10000 TOKENLEASE=/path/to/tokenlease bash scripts/statement-instructions.sh ...
#   bash scripts/statement-instructions.sh - scripts/statements/peer-upsert.sql   # beside the peer's
#   CALLGRIND_OUT=dir bash scripts/statement-instructions.sh ...   # keep each candidate's profile
#       (dir/<n>.callgrind, the run of 100 + N executions), for `callgrind_annotate --inclusive=yes`
#   SETUP=scripts/statements/narrow-table.sql bash scripts/statement-instructions.sh \
#       scripts/statements/narrow-*.sql   # SETUP: SQL run on the cluster after the migrations
#   BATCH=16 bash scripts/statement-instructions.sh - A.sql   # many-key candidates (`-`: the
#       # store's many-key take), BATCH distinct keys an execution, the figure per key
#   BATCH=16 NEW=1 bash scripts/statement-instructions.sh - A.sql   # every key without a row
#   UNPREP=1 bash scripts/statement-instructions.sh scripts/statements/peer-upsert.sql
#       # each execution sent as a plain statement, its parameters written in as typed literals:
#       # parsed, analysed and planned every time, as an unnamed statement is (what a client
#       # that does not prepare pays; the Node peer names its upsert, so node-postgres prepares it)
#
# A candidate is one SQL statement with the one-key take's parameters ($1 text key, $2
# capacity, $3 rate, $4 min, $5 want, $6 step, bigint nanotokens; `tokenlease loadtest
# --print-statement one` prints the store's). The script makes a throwaway cluster (initdb, as
# the `postgres` user through runuser when run as root), migrates it with `tokenlease migrate`,
# stores a full bucket for each of $KEYS keys and stops it. Each candidate then runs from a
# fresh copy of that cluster in `postgres --single` under callgrind: PREPARE, then 100 and
# 100 + $N EXECUTEs on random keys (a fixed sequence: capacity 100 tokens, 50 tokens/s, take
# exactly 1 token, as scripts/peer-compare.sh sends), and the difference over $N is the
# figure: parse, plan, executor start, the statement, its commit (fsync off) and printing the
# returned row, which single-user mode does for every candidate alike. With BATCH=n a candidate
# takes the many-key take's parameters ($1 text[] keys, $2..$6 bigint[], `--print-statement
# many`): each execution sends n distinct random keys in key order (with NEW=1 keys that have
# no row yet, each used once), and the figure is per key.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N="${N:-500}"
KEYS="${KEYS:-10000}"
[[ $# -ge 1 ]] || { echo "usage: $0 A.sql [B.sql ...]" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "statement-instructions: valgrind is not on PATH" >&2; exit 1; }
pg_bin="${PG_BIN:-$(dirname "$(command -v initdb 2>/dev/null || echo /usr/lib/postgresql/15/bin/initdb)")}"
[[ -x "$pg_bin/postgres" ]] || { echo "statement-instructions: no postgres in $pg_bin (set PG_BIN)" >&2; exit 1; }
source scripts/lib.sh
tokenlease_bin
as_server() { # PostgreSQL refuses to run as root.
    if [[ "$(id -u)" == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}
tmp="$(mktemp -d)"
chmod 755 "$tmp"
[[ "$(id -u)" == 0 ]] && chown postgres "$tmp"
cleanup() {
    as_server "$pg_bin/pg_ctl" -D "$tmp/pristine" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$tmp"
}
trap cleanup EXIT

port=$((20000 + RANDOM % 20000))
as_server "$pg_bin/initdb" -D "$tmp/pristine" -A trust -U postgres --no-sync >/dev/null
as_server "$pg_bin/pg_ctl" -D "$tmp/pristine" -w -l "$tmp/server.log" \
    -o "-p $port -k $tmp -c listen_addresses='' -c fsync=off" start >/dev/null
url="host=$tmp port=$port user=postgres dbname=postgres"
"$bin" migrate --database-url "$url" >/dev/null
if [[ -n "${SETUP:-}" ]]; then # more tables for the candidates, made before the snapshot
    psql "$url" -X -q -v ON_ERROR_STOP=1 -f "$SETUP" >/dev/null
fi
psql "$url" -X -q -v ON_ERROR_STOP=1 -c "
INSERT INTO tokenlease_buckets (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
SELECT 'pgbench:' || i, 100000000000, 0, 100000000000, 50000000000,
       (extract(epoch FROM now()) * 1000000)::bigint, 100000000000
FROM generate_series(1, $KEYS) AS i;
CREATE TABLE rlf (key varchar(255) PRIMARY KEY, points integer NOT NULL DEFAULT 0, expire bigint);
INSERT INTO rlf SELECT 'pgbench:' || i, 1, 9999999999999 FROM generate_series(1, $KEYS) AS i" >/dev/null
as_server "$pg_bin/pg_ctl" -D "$tmp/pristine" -w stop >/dev/null

# The input of one run: the statement prepared, then COUNT executions on random keys.
input() { # FILE COUNT OUT
    if [[ -n "${UNPREP:-}" ]]; then
        python3 - "$1" "$2" "$KEYS" >"$3" <<'PY'
import random, re, sys
lines = open(sys.argv[1]).read().splitlines()
text = " ".join(l for l in lines if not l.strip().startswith("--")).strip().rstrip(";")
count, keys = int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(7)
for _ in range(count):
    values = {"1": f"'pgbench:{rng.randint(1, keys)}'::text", "2": "100000000000::bigint",
              "3": "50000000000::bigint", "4": "1000000000::bigint", "5": "1000000000::bigint",
              "6": "1000000000::bigint"}
    print(re.sub(r"\$([1-6])(?![0-9])", lambda m: values[m.group(1)], text) + ";")
    print()
PY
        return
    fi
    if [[ -n "${BATCH:-}" ]]; then
        {
            echo "PREPARE s(text[], bigint[], bigint[], bigint[], bigint[], bigint[]) AS $(
                grep -v '^[[:space:]]*--' "$1" | tr '\n' ' ' | sed 's/;[[:space:]]*$//');"
            echo
            python3 - "$2" "$KEYS" "$BATCH" "${NEW:-}" <<'PY'
import random, sys
count, keys, batch, new = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(7)
fresh = 0
for _ in range(count):
    if new:
        names = [f"new:{fresh + i}" for i in range(batch)]
        fresh += batch
    else:
        names = [f"pgbench:{i}" for i in rng.sample(range(1, keys + 1), batch)]
    names.sort()
    arr = lambda v: "'{" + ",".join([v] * batch) + "}'"
    print(f"EXECUTE s('{{{','.join(names)}}}', {arr('100000000000')}, {arr('50000000000')}, "
          f"{arr('1000000000')}, {arr('1000000000')}, {arr('1000000000')});")
    print()
PY
        } >"$3"
        return
    fi
    {
        echo "PREPARE s(text, bigint, bigint, bigint, bigint, bigint) AS $(
            grep -v '^[[:space:]]*--' "$1" | tr '\n' ' ' | sed 's/;[[:space:]]*$//');"
        echo
        python3 - "$2" "$KEYS" <<'PY'
import random, sys
count, keys = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(7)
for _ in range(count):
    print(f"EXECUTE s('pgbench:{rng.randint(1, keys)}', 100000000000, 50000000000, "
          "1000000000, 1000000000, 1000000000);")
    print()
PY
    } >"$3"
}
# The instructions of one run from a fresh copy of the cluster.
instructions() { # INPUT [PROFILE]
    rm -rf "$tmp/data"
    cp -a "$tmp/pristine" "$tmp/data"
    as_server valgrind --tool=callgrind --callgrind-out-file="${2:-/dev/null}" \
        "$pg_bin/postgres" --single -j -D "$tmp/data" -c fsync=off postgres \
        <"$1" >"$tmp/out" 2>"$tmp/err"
    if grep -q 'ERROR' "$tmp/out" "$tmp/err"; then
        grep -m 3 'ERROR' "$tmp/out" "$tmp/err" >&2
        exit 1
    fi
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$tmp/err"
}

echo "| candidate | instructions per execution |"
echo "|---|---|"
for file in "$@"; do
    name="$file"
    if [[ "$file" == - ]]; then
        if [[ -n "${BATCH:-}" ]]; then
            "$bin" loadtest --print-statement many >"$tmp/store.sql"
            name="the store's many-key take (lean.rs), $BATCH keys a call"
        else
            "$bin" loadtest --print-statement one >"$tmp/store.sql"
            name="the store's one-key take (lean.rs)"
        fi
        file="$tmp/store.sql"
    fi
    input "$file" 100 "$tmp/base.in"
    input "$file" $((100 + N)) "$tmp/run.in"
    base="$(instructions "$tmp/base.in")"
    if [[ -n "${CALLGRIND_OUT:-}" ]]; then
        mkdir -p "$CALLGRIND_OUT"
        chmod 777 "$CALLGRIND_OUT"
        n=$((${n:-0} + 1))
        run="$(instructions "$tmp/run.in" "$(realpath "$CALLGRIND_OUT")/$n.callgrind")"
        echo "profile of $name: $CALLGRIND_OUT/$n.callgrind" >&2
    else
        run="$(instructions "$tmp/run.in")"
    fi
    echo "| $name | $(((run - base) / N / ${BATCH:-1})) |"
done
