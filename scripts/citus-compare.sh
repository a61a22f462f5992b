#!/usr/bin/env bash
# Citus against ShardedStore on this machine: `tokenlease loadtest` over one throwaway cluster,
# N throwaway primaries (`--shards N`, the keys spread by ShardedStore), and a throwaway Citus
# cluster of a coordinator and N workers (`--citus N`, with Citus's 32 shards and with one
# shard per worker), alternated in one sitting, REPEAT times. Every run is
#
#   tokenlease loadtest --mode $MODE --keys $KEYS --instances 1 --tasks $TASKS --rate 100000
#       --duration $DURATION_S --json  <the set-up>
#
# (the release build). Prints one row per run: requests/s, statements/s, decisions per
# statement, p99, server CPU per decision (every node's cluster summed) and, for Citus, each
# node's share and each worker's routed calls per second. The JSON reports go to $OUT.
#
#   bash scripts/citus-compare.sh            # N = 2, direct mode, twice each
#   MODE=leased KEYS=1000 REPEAT=1 bash scripts/citus-compare.sh 3
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N="${1:-2}"
MODE="${MODE:-direct}"
KEYS="${KEYS:-100000}"
TASKS="${TASKS:-64}"
DURATION_S="${DURATION_S:-10}"
REPEAT="${REPEAT:-2}"
target="${CARGO_TARGET_DIR:-target}"
source scripts/lib.sh
tokenlease_bin
OUT="${OUT:-$target/citus-compare/results.jsonl}"
mkdir -p "$(dirname "$OUT")"

# One table row from a report (in $JSON; the set-up in $SETUP).
read -r -d '' ROW <<'PY' || true
import json, os
r = json.loads(os.environ["JSON"])
nodes = ""
if r.get("citus_nodes"):
    cpu = r.get("citus_node_cpu_us_per_decision") or []
    names = [n.split(":")[0] for n in r["citus_nodes"]]
    nodes = ", ".join("%s %.0f" % (n, c) for n, c in zip(names, cpu))
    nodes += "; calls/s " + ", ".join("%.0f" % c for c in r["citus_worker_calls_per_s"])
    nodes += "; 2PC %s" % r.get("citus_two_phase_commits")
elif len(r["shard_db_calls_per_s"]) > 1:
    nodes = "statements/s per shard " + ", ".join("%.0f" % c for c in r["shard_db_calls_per_s"])
cpu = r.get("server_cpu_us_per_decision")
print("%-26s %11.0f %12.0f %10.2f %9.1f %14.1f  %s" % (
    os.environ["SETUP"], r["throughput_per_s"], r["db_calls_per_s"],
    r["decisions_per_statement"], r["p99_us"] / 1000,
    cpu if cpu is not None else float("nan"), nodes))
PY

echo "cores: $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
printf '%-26s %11s %12s %10s %9s %14s  %s\n' set-up requests/s statements/s "dec/stmt" "p99 ms" \
    "CPU µs/dec" "per node (µs/decision; worker calls/s)"
for ((round = 0; round < REPEAT; round++)); do
    for setup in "--shards 1" "--shards $N" "--citus $N" "--citus $N --citus-shards $N"; do
        # shellcheck disable=SC2086
        json="$("$bin" loadtest --mode "$MODE" --keys "$KEYS" --instances 1 --tasks "$TASKS" \
            --rate 100000 --duration "$DURATION_S" --json $setup 2>/dev/null)"
        echo "$json" >>"$OUT"
        SETUP="$setup" JSON="$json" python3 -c "$ROW"
    done
done
