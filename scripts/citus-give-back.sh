#!/usr/bin/env bash
# Time per call of a Citus worker's return function (`tokenlease_citus_give_back`, what lease
# expiry and `Store::give_back_each` send a node) with two builds' definitions, alternated on one
# throwaway cluster in one sitting.
#
# Starts a coordinator and two workers (pg_ctl, Citus's extension, fsync off), migrates with
# BEFORE's `tokenlease migrate` and then AFTER's, keeping each one's definition of the function,
# fills the shards with FILL rows, then for ROUNDS rounds puts each definition in place (on the
# coordinator, which replaces it on every node) and runs, on the first worker, CALLS
# calls in one session, each returning N keys of that worker (256 and 2,048; every call new return
# ids, so every return credits). Prints the wall time and the worker backend's CPU time per
# call (the machine's other load inflates the first, less the second).
#
#   TOKENLEASE_BEFORE=/path/old/tokenlease TOKENLEASE_AFTER=/path/new/tokenlease \
#       bash scripts/citus-give-back.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BEFORE="${TOKENLEASE_BEFORE:?set it to the older build (a tokenlease binary)}"
AFTER="${TOKENLEASE_AFTER:?set it to the newer build (a tokenlease binary)}"
ROUNDS="${ROUNDS:-3}"
CALLS="${CALLS:-100}"
FILL="${FILL:-400000}"
PORT="${PORT:-58200}"
ports=("$PORT" $((PORT + 1)) $((PORT + 2)))
dir="$(mktemp -d)"
as_server=()
if [[ $(id -u) == 0 ]]; then
    as_server=(runuser -u postgres --)
    chown postgres "$dir"
fi
bindir="$(pg_config --bindir)"
stop() {
    for p in "${ports[@]}"; do
        [[ -f "$dir/$p/postmaster.pid" ]] &&
            "${as_server[@]}" "$bindir/pg_ctl" -D "$dir/$p" -m immediate stop >/dev/null 2>&1
    done
    rm -rf "$dir"
}
trap stop EXIT
trap "exit 1" INT TERM
sql() { psql -h 127.0.0.1 -p "$1" -U postgres -qAtX -v ON_ERROR_STOP=1 "${@:2}"; }

for p in "${ports[@]}"; do
    "${as_server[@]}" "$bindir/initdb" -D "$dir/$p" -U postgres --auth=trust -N >/dev/null
    cat >>"$dir/$p/postgresql.conf" <<CONF
port = $p
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
shared_preload_libraries = 'citus'
max_prepared_transactions = 100
fsync = off
full_page_writes = off
CONF
    "${as_server[@]}" "$bindir/pg_ctl" -D "$dir/$p" -l "$dir/$p.log" -w start >/dev/null
    sql "$p" -c "CREATE EXTENSION citus"
done
c="${ports[0]}"
w="${ports[1]}"
sql "$c" -c "SELECT citus_set_coordinator_host('127.0.0.1', $c)" >/dev/null
sql "$c" -c "SELECT citus_add_node('127.0.0.1', $w), citus_add_node('127.0.0.1', ${ports[2]})" >/dev/null
url="postgresql://postgres@127.0.0.1:$c/postgres"
def() { sql "$w" -c "SELECT pg_get_functiondef('tokenlease_citus_give_back'::regproc) || ';'"; }
"$BEFORE" migrate --database-url "$url" >/dev/null
def >"$dir/before.sql"
"$AFTER" migrate --database-url "$url" >/dev/null
def >"$dir/after.sql"

# 2,048 keys of the first worker with drained buckets, FILL more rows over every shard, and the
# calls' arguments in a table of the worker's own.
keys="$(sql "$c" -c "SELECT string_agg(quote_literal(u.k), ',' ORDER BY u.n)
    FROM unnest(ARRAY(SELECT 'gb-' || i FROM generate_series(1, 20000) AS i))
         WITH ORDINALITY AS u(k, n)
    JOIN pg_dist_placement AS p
      ON p.shardid = get_shard_id_for_distribution_column('tokenlease_buckets', u.k)
    JOIN pg_dist_node AS d ON d.groupid = p.groupid
    WHERE d.nodeport = $w AND u.n <= 5000")"
sql "$c" -c "INSERT INTO tokenlease_buckets
        (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
    SELECT k, 0, 0, 1000000000000000, 1, 0, 0 FROM unnest(ARRAY[$keys]) AS k
    UNION ALL
    SELECT 'fill-' || i, 0, 0, 1000000000, 1, 0, 0 FROM generate_series(1, $FILL) AS i"
sql "$c" -c "ANALYZE tokenlease_buckets"
sql "$w" -c "CREATE TABLE bench_args (n integer PRIMARY KEY, k text[], amounts bigint[],
                                      caps bigint[], rates bigint[], holders bigint[])"
for n in 256 2048; do
    sql "$w" -c "INSERT INTO bench_args SELECT $n, k[1:$n],
        array_fill(1000::bigint, ARRAY[$n]), array_fill(1000000000000000::bigint, ARRAY[$n]),
        array_fill(1::bigint, ARRAY[$n]), array_fill(NULL::bigint, ARRAY[$n])
        FROM (SELECT ARRAY[$keys] AS k) AS s"
done
# One session on the worker runs CALLS calls, each its own transaction (as the store's are: in
# one transaction the calls' row versions would pile up); its backend's CPU time (utime + stime,
# /proc/<pid>/stat) and the calls' wall time, per call.
run() { # build, keys
    {
        echo "SELECT pg_backend_pid() AS pid \\gset"
        echo "\\setenv BACKEND :pid"
        echo "\\! awk '{print \$14 + \$15}' /proc/\$BACKEND/stat >$dir/cpu0"
        echo "SELECT extract(epoch FROM clock_timestamp()) AS t0 \\gset"
        for ((call = 0; call < CALLS; call++)); do
            echo "SELECT count(*) FROM bench_args AS a, tokenlease_citus_give_back(a.k[1],
                ARRAY(SELECT (random() * 1e12)::bigint * 10000 + j
                      FROM generate_series(1, $2) AS j),
                a.k, a.amounts, a.caps, a.rates, a.holders, a.holders) WHERE a.n = $2 \\g /dev/null"
        done
        echo "SELECT round(((extract(epoch FROM clock_timestamp()) - :t0) * 1000
                            / $CALLS)::numeric, 2) AS wall \\gset"
        echo "\\! awk '{print \$14 + \$15}' /proc/\$BACKEND/stat >$dir/cpu1"
        echo "\\echo :wall"
    } >"$dir/run.sql"
    local wall cpu0 cpu1 hz
    wall="$(sql "$w" -f "$dir/run.sql")"
    hz="$(getconf CLK_TCK)"
    cpu0="$(cat "$dir/cpu0")"
    cpu1="$(cat "$dir/cpu1")"
    printf '%-6s %-7s %6s %12s %12s\n' "$round" "$1" "$2" "$wall" \
        "$(echo "scale=2; ($cpu1 - $cpu0) * 1000 / $hz / $CALLS" | bc)"
}

echo "cores: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg); shards of tokenlease_buckets" \
    "hold $(sql "$c" -c "SELECT count(*) FROM tokenlease_buckets") rows"
printf '%-6s %-7s %6s %12s %12s\n' round build keys "wall ms/call" "CPU ms/call"
for ((round = 1; round <= ROUNDS; round++)); do
    for build in before after; do
        sql "$c" -f "$dir/$build.sql" >/dev/null
        for n in 256 2048; do
            run "$build" "$n"
        done
    done
done
