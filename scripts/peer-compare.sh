#!/usr/bin/env bash
# tokenlease against a peer on ONE throwaway PostgreSQL, in one run, phase after phase:
#
#   1. rate-limiter-flexible's RateLimiterPostgres (Node, peers/rlf-postgres.js): 10,000 random
#      keys, 16 requests in flight over a pg Pool of 16 connections; then a lone caller (1 in
#      flight), with the server's durable commits and with `synchronous_commit = off` (the
#      store's default commit, docs/design/statements.md), so each of tokenlease's lone callers has a
#      peer with the same commit beside it;
#   2. pgbench, 16 clients, one random key of 10,000: the one-key take tokenlease sends
#      (src/store/postgres/lean.rs, printed by `tokenlease loadtest --print-statement one`), with
#      `-M extended` (an unnamed statement, parsed and planned on every call) and `-M prepared`
#      (parsed and planned once per connection, as the store does by default); then the ceiling
#      for 16 callers: the many-key take with 16 keys a call from 1 client, and with 8 from 2
#      clients (at most 16 requests in flight either way);
#   3. tokenlease loadtest, 1 instance × 16 tasks: direct mode on 10,000 keys as a closed loop
#      (--rate far above what is reachable, so each task sends as soon as it is answered) with
#      the default pool of 4, with 16 connections, and with the pool of 4 but 2 statements in
#      flight (tuned: more keys share each commit on a small server), the default pool with
#      every statement unnamed (--unprepared), and a lone caller (1 task), also with durable
#      commits (--durable-commits); leased mode on
#      100,000 keys paced at 100,000 requests/s with the default lease settings and with leases
#      living 30 s (16 serial tasks: a call waiting for a refill delays its task's next); the
#      same rate kept while calls wait (--in-flight 64, an open loop: each key called about once
#      a second), on 100,000 keys and on 10,000 keys at 10,000/s, over $LEASED_S seconds (20 by
#      default) with the server's CPU read after half of them (--warmup); leased mode on 10,000
#      keys as a closed loop with leases living 30 s.
#
# and prints one table with the ratios to the Node peer, the server's CPU per decision among
# them: the CPU seconds of the whole PostgreSQL cluster (postmaster, backends, background
# processes, exited ones included; read from /proc) over the decisions served. For the Node peer
# and pgbench the script reads it just before and just after the phase's process (so the
# phase's connecting and, for the peer, its table set-up are in it); for tokenlease it is the
# loadtest's own `server_cpu_us_per_decision`, over its measured window alone. Each phase runs
# $PHASE_S seconds (10 by
# default: about a minute in all, build aside). The server is started by
# `tokenlease loadtest --serve-db` (migrated, removed at the end). Installs peers/node_modules
# with `npm ci` when missing. The raw JSON lines go to target/peer-compare/results.jsonl.
#
#   bash scripts/peer-compare.sh
#   PHASE_S=3 bash scripts/peer-compare.sh    # a quick check
#   TOKENLEASE=/path/to/tokenlease bash scripts/peer-compare.sh    # a prebuilt binary
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PHASE_S="${PHASE_S:-10}"
for tool in node npm pgbench python3; do
    command -v "$tool" >/dev/null || { echo "peer-compare: $tool is not on PATH" >&2; exit 1; }
done
source scripts/lib.sh
tokenlease_bin
if [[ ! -d peers/node_modules/rate-limiter-flexible || ! -d peers/node_modules/pg ]]; then
    echo "peer-compare: installing the Node peer's dependencies (npm ci in peers/)" >&2
    (cd peers && npm ci --no-audit --no-fund)
fi
out_dir=target/peer-compare
out="$out_dir/results.jsonl"
mkdir -p "$out_dir"
: >"$out"
tmp="$(mktemp -d)"

# One throwaway server for every phase.
serve_pid=
cleanup() {
    kill -TERM "$serve_pid" 2>/dev/null || true
    wait "$serve_pid" 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT
serve_db peer-compare
echo "peer-compare: PostgreSQL at $url, $PHASE_S s per phase" >&2

# The server's CPU, as `tokenlease loadtest` reads it (cli/src/server_cpu.rs).
# The postmaster: the parent (PPid) of the backend that answers `pg_backend_pid()`, read while
# that session is still open (psql's \setenv and \! run inside it), when it is a postgres
# process of this machine; nothing otherwise.
postmaster_of() { # URL
    psql "$1" -X -q -At -v ON_ERROR_STOP=1 2>/dev/null <<'SQL' || true
SELECT pg_backend_pid() AS backend_pid \gset
\setenv PEER_COMPARE_BACKEND :backend_pid
\! ppid=$(awk '/^PPid:/ { print $2 }' "/proc/$PEER_COMPARE_BACKEND/status" 2>/dev/null); comm=$(cat "/proc/$ppid/comm" 2>/dev/null); { [ "$comm" = postgres ] || [ "$comm" = postmaster ]; } && echo "$ppid"
SQL
}
postmaster="$(postmaster_of "$url")"
if [[ -z "$postmaster" ]]; then
    echo "peer-compare: the server's postmaster is not on this machine: no server CPU figures for the peers" >&2
fi
# The cluster's CPU seconds so far: the postmaster's utime + stime + cutime + cstime (cutime
# and cstime hold the backends that exited and were reaped) plus the same four of each of its
# live children, from /proc/<pid>/stat, in clock ticks. Read the postmaster, the children, the
# postmaster again, and read again (at most 5 times) while its reaped time moved during the scan,
# so that no child is counted both live and reaped. Prints nothing when the postmaster is gone
# (exited: a zombie still listed until its parent reaps it counts as gone).
cat >"$tmp/cluster_cpu.py" <<'PY'
import os, sys

def stat(pid):
    try:
        line = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and ')', so count after the last ')'.
    f = line[line.rindex(")") + 2:].split()
    ppid, times = int(f[1]), [int(x) for x in f[11:15]]  # fields 4 and 14-17
    return ppid, sum(times), times[2] + times[3], f[0] in ("Z", "X")  # field 3: exited

def postmaster_stat(pid):
    # A postmaster that exited (a zombie until its parent reaps it) is gone.
    s = stat(pid)
    return None if s is None or s[3] else s

postmaster = int(sys.argv[1])
for attempt in range(5):
    before = postmaster_stat(postmaster)
    if before is None:
        sys.exit(0)
    children = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = stat(name)
            if s is not None and s[0] == postmaster:
                children += s[1]
    after = postmaster_stat(postmaster)
    if after is None:
        sys.exit(0)
    if after[2] == before[2]:
        break
print((after[1] + children) / os.sysconf("SC_CLK_TCK"))
PY
cluster_cpu() {
    if [[ -n "$postmaster" ]]; then python3 "$tmp/cluster_cpu.py" "$postmaster"; fi
}
# Adds to the last line of the results the server's CPU between the readings START and END
# (empty when not measured): server_cpu_s, and server_cpu_us_per_decision over the row's
# `decisions` (decisions served: admitted and denied, not errors).
add_server_cpu() { # START END
    python3 - "$out" "$1" "$2" <<'PY'
import json, sys
path, start, end = sys.argv[1:]
lines = open(path).read().splitlines()
r = json.loads(lines[-1])
if start and end:
    s = float(end) - float(start)
    r["server_cpu_s"] = s
    r["server_cpu_us_per_decision"] = s * 1e6 / r["decisions"] if r["decisions"] else None
else:
    r["server_cpu_s"] = r["server_cpu_us_per_decision"] = None
lines[-1] = json.dumps(r)
open(path, "w").write("\n".join(lines) + "\n")
PY
}

# One phase of the Node peer: IN_FLIGHT requests in flight over a pool of as many connections,
# the row labelled LABEL; PGOPTIONS passes through to the peer's sessions.
peer_phase() { # LABEL IN_FLIGHT
    echo "== 1/4 $1" >&2
    cpu_start="$(cluster_cpu)"
    node peers/rlf-postgres.js --url "$url" --keys 10000 --concurrency "$2" --pool "$2" \
        --duration "$PHASE_S" | LABEL="$1" python3 -c '
import json, os, sys
r = json.loads(sys.stdin.read())
r["client"] = os.environ["LABEL"]
r["decisions"] = r["allowed"] + r["denied"]
print(json.dumps(r))' >>"$out"
    add_server_cpu "$cpu_start" "$(cluster_cpu)"
}
peer_phase "rate-limiter-flexible (Node), 16 in flight" 16
peer_phase "rate-limiter-flexible (Node), 1 in flight (a lone caller)" 1
# The same lone caller with tokenlease's default commit.
PGOPTIONS="-c synchronous_commit=off" \
    peer_phase "rate-limiter-flexible (Node), 1 in flight (a lone caller), synchronous_commit = off" 1

echo "== 2/4 pgbench, 16 clients, tokenlease's statement on one random key of 10,000" >&2
# The one-key take the store sends (src/store/postgres/lean.rs, printed by the binary), its six
# parameters replaced: key pgbench:<n>, capacity 100, refill 50/s, take exactly 1 (min = want =
# step = 1), all in nanotokens, as direct mode sends it.
"$bin" loadtest --print-statement one >"$tmp/one.sql"
"$bin" loadtest --print-statement many >"$tmp/many.sql"
pgbench_script() { # FILE OUT
    {
        echo '\set key random(1, 10000)'
        grep -v '^[[:space:]]*--' "$1" |
            sed -e "s/\\\$1/('pgbench:' || :key::text)/g" \
                -e "s/\\\$2/100000000000::bigint/g" \
                -e "s/\\\$3/50000000000::bigint/g" \
                -e "s/\\\$[456]/1000000000::bigint/g"
        echo ';'
    } >"$2"
    if grep -q '\$[0-9]' "$2"; then
        echo "peer-compare: $1 has parameters this script does not replace:" >&2
        grep -n '\$[0-9]' "$2" >&2
        exit 1
    fi
}
# One result line from the last pgbench run (its output and per-transaction logs in $tmp):
# LABEL, and KEYS decisions per transaction (served decisions/s = tps × KEYS; the latencies are
# a transaction's).
pgbench_row() { # LABEL KEYS
    python3 - "$tmp" "$1" "$2" >>"$out" <<'PY'
import glob, json, math, re, sys
tmp, label, keys = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(f"{tmp}/pgbench.out").read()
lat, failed = [], 0
for path in glob.glob(f"{tmp}/pgbench_log*"):
    for line in open(path):
        # client_id transaction_no time script_no time_epoch time_us; time in µs, or
        # "failed"/"skipped" for a transaction that did not complete.
        f = line.split()
        if f[2].isdigit():
            lat.append(int(f[2]))
        else:
            failed += 1
lat.sort()
def pct(q):  # nearest rank
    return lat[min(len(lat) - 1, max(0, math.ceil(q * len(lat)) - 1))] if lat else 0
dur = float(re.search(r"duration: (\d+) s", text).group(1))
tps = float(re.search(r"tps = ([\d.]+) \(without initial", text).group(1))
print(json.dumps({
    "client": label, "requests": len(lat) * keys, "decisions": len(lat) * keys,
    "per_sec": tps * keys,
    "p50_us": pct(0.5), "p99_us": pct(0.99), "p999_us": pct(0.999),
    "max_us": lat[-1] if lat else 0, "errors": failed, "duration_s": dur,
    "statements_per_1k": 1000 / keys,
}))
PY
}
pgbench_script "$tmp/one.sql" "$tmp/one.pgbench"
for protocol in extended prepared; do
    label="one-key take, what tokenlease sends (lean.rs)"
    echo "== 2/4 pgbench -M $protocol, $label" >&2
    rm -f "$tmp"/pgbench_log*
    cpu_start="$(cluster_cpu)"
    (cd "$tmp" && pgbench -n -M "$protocol" -c 16 -j 2 -T "$PHASE_S" -f one.pgbench \
        -l --log-prefix=pgbench_log "$url" >pgbench.out 2>pgbench.err) || {
        cat "$tmp/pgbench.err" >&2
        exit 1
    }
    cpu_end="$(cluster_cpu)"
    pgbench_row "pgbench -M $protocol, 16 clients, $label, 1 key" 1
    add_server_cpu "$cpu_start" "$cpu_end"
done

# The most any client with 16 callers can get from this server: with 16 requests in flight at
# most, a client serves at most 16 ÷ (one statement's time) decisions a second, and the fastest
# it can do is send all 16 in one statement (or 8 in each of two). tokenlease's statement with
# 16 (then 8) distinct random keys per call, -M prepared, 1 (then 2) pgbench clients: served
# decisions/s = tps × keys, and the statement's own latency as p50/p99.
echo "== 2/4 pgbench, the statement with many keys per call: the ceiling for 16 callers" >&2
for shape in "16 1" "8 2"; do
    read -r keys clients <<<"$shape"
    {
        echo "\\set k random(0, $((10000 / keys - 1)))"
        grep -v '^[[:space:]]*--' "$tmp/many.sql" |
            sed -e "s/\\\$1::text\\[\\]/ARRAY(SELECT 'pgbench:' || (:k * $keys + i)::text FROM generate_series(0, $((keys - 1))) AS i)/g" \
                -e "s/\\\$2::bigint\\[\\]/array_fill(100000000000::bigint, ARRAY[$keys])/" \
                -e "s/\\\$3::bigint\\[\\]/array_fill(50000000000::bigint, ARRAY[$keys])/" \
                -e "s/\\\$[456]::bigint\\[\\]/array_fill(1000000000::bigint, ARRAY[$keys])/g"
        echo ';'
    } >"$tmp/many.pgbench"
    if grep -q '\$[0-9]' "$tmp/many.pgbench"; then
        echo "peer-compare: the many-key statement has parameters this script does not replace" >&2
        exit 1
    fi
    rm -f "$tmp"/pgbench_log*
    cpu_start="$(cluster_cpu)"
    (cd "$tmp" && pgbench -n -M prepared -c "$clients" -j "$clients" -T "$PHASE_S" -f many.pgbench \
        -l --log-prefix=pgbench_log "$url" >pgbench.out 2>pgbench.err) || {
        cat "$tmp/pgbench.err" >&2
        exit 1
    }
    cpu_end="$(cluster_cpu)"
    pgbench_row "pgbench -M prepared, $clients client(s), the many-key take with $keys keys a call (the ceiling for 16 callers: 16 in flight at most); p50/p99 are a statement's" "$keys"
    add_server_cpu "$cpu_start" "$cpu_end"
done

# tokenlease's own load test, as a user would run it: the default pool (4 connections) and the
# default lease settings first, then the settings that suit the workload, each labelled.
loadtest_phase() {
    local label="$1"
    shift
    echo "== 3/4 tokenlease loadtest: $label" >&2
    "$bin" loadtest --database-url "$url" --json --instances 1 --tasks "${TASKS:-16}" \
        --duration "$PHASE_S" "$@" |
        LABEL="$label" python3 -c '
import json, os, sys
r = json.loads(sys.stdin.read())
r["client"] = os.environ["LABEL"]
print(json.dumps(r))' >>"$out"
}
loadtest_phase "tokenlease direct, 10,000 keys, 1 × 16 tasks, closed loop, default pool (4)" \
    --mode direct --keys 10000 --rate 1000000
loadtest_phase "tokenlease direct, 10,000 keys, 1 × 16 tasks, closed loop, pool 16" \
    --mode direct --keys 10000 --rate 1000000 --pool 16
loadtest_phase "tokenlease direct, 10,000 keys, 1 × 16 tasks, closed loop, pool 4, 2 statements in flight (tuned)" \
    --mode direct --keys 10000 --rate 1000000 --statements-in-flight 2
loadtest_phase "tokenlease direct, 10,000 keys, 1 × 16 tasks, closed loop, default pool (4), unnamed statements" \
    --mode direct --keys 10000 --rate 1000000 --unprepared
TASKS=1 loadtest_phase "tokenlease direct, 10,000 keys, 1 × 1 task, closed loop (a lone caller)" \
    --mode direct --keys 10000 --rate 1000000
TASKS=1 loadtest_phase "tokenlease direct, 10,000 keys, 1 × 1 task, closed loop (a lone caller), durable commits" \
    --mode direct --keys 10000 --rate 1000000 --durable-commits
loadtest_phase "tokenlease leased, 100,000 keys at 100,000/s, 1 × 16 tasks, default lease settings" \
    --mode leased --keys 100000 --rate 100000
loadtest_phase "tokenlease leased, 100,000 keys at 100,000/s, 1 × 16 tasks, leases living 30 s" \
    --mode leased --keys 100000 --rate 100000 --lease-ttl-ms 30000
loadtest_phase "tokenlease leased, 10,000 keys, 1 × 16 tasks, closed loop, leases living 30 s" \
    --mode leased --keys 10000 --rate 1000000 --lease-ttl-ms 30000
# Last, since they write far more rows than the rows above (a closed-loop row run after them
# met the server still busy with their aftermath): the same offered rate kept while calls wait
# (each task keeps up to 64 calls in flight, as a service whose every request is its own task):
# each key is called about once a second, and
# the server's CPU is read after a warm-up (the first call of each key writes its row once),
# over LEASED_S seconds in all (20 by default).
loadtest_phase_open() {
    local label="$1"
    shift
    PHASE_S="${LEASED_S:-20}" loadtest_phase "$label" --in-flight 64 \
        --warmup "$(python3 -c "print(${LEASED_S:-20} / 2)")" "$@"
}
loadtest_phase_open "tokenlease leased, 100,000 keys at 100,000/s offered (64 in flight a task), default lease settings, CPU after a warm-up" \
    --mode leased --keys 100000 --rate 100000
loadtest_phase_open "tokenlease leased, 10,000 keys at 10,000/s offered (64 in flight a task), default lease settings, CPU after a warm-up" \
    --mode leased --keys 10000 --rate 10000

echo
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def per_s(r):
    return r.get("per_sec", r.get("throughput_per_s", 0.0))
def stmts(r):
    return r.get("statements_per_1k", r.get("db_calls_per_1k"))
base = rows[0]
def offered(r):
    # Closed loops (the peers, and loadtest at an unreachable --rate) offer what they are served.
    rate = r.get("rate_per_s")
    return "closed loop" if rate is None or rate >= 1e6 else f"{rate:,.0f}"
def cpu(r):
    # The server's CPU µs per decision served: the peers' measured by this script around their
    # phase, tokenlease's by the loadtest over its measured window; None when not measured.
    return r.get("server_cpu_us_per_decision")
def cpu_cells(r):
    if cpu(r) is None:
        return "– | –"
    ratio = f"{cpu(r) / cpu(base):.2f}" if cpu(base) else "–"
    return f"{cpu(r):,.1f} | {ratio}"
print("| client | offered /s | requests | served /s | × Node peer | statements / 1k | server CPU µs/decision | × Node peer | p50 µs | × Node peer | p99 µs | max µs | errors (peers) or fallback decisions (tokenlease) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    errs = r.get("errors", r.get("fallback_decisions", 0))
    print(f'| {r["client"]} | {offered(r)} | {r["requests"]:,} | {per_s(r):,.0f} | {per_s(r) / per_s(base):.2f} '
          f'| {stmts(r):.1f} | {cpu_cells(r)} | {r["p50_us"]:,.1f} | {r["p50_us"] / base["p50_us"]:.3f} '
          f'| {r["p99_us"]:,.1f} | {r["max_us"]:,.1f} | {errs} |')
missing = [r["client"] for r in rows if cpu(r) is None]
if missing:
    print()
    for r in rows:
        if cpu(r) is None:
            why = r.get("server_cpu_not_measured", "the server is not on this machine")
            print(f"server CPU not measured for {r['client']}: {why}")
PY
echo
echo "results: $out"
