#!/usr/bin/env bash
# The slowest decision under each fault: `tokenlease loadtest --fault` for every fault
# (sigstop, slow, down, restart) × mode (direct, leased) × keys (1, 10,000), one instance of
# 512 tasks at $RATE requests/s (20,000 by default) for $DURATION seconds (5), the fault from
# 1 s to 3 s (`restart` at 1 s). Each run starts its own throwaway PostgreSQL.
#
# Prints a markdown table (max and p99 latency against the bound of 2 × the store's 50 ms call
# timeout + 10 ms, fallback decisions, requests served) and keeps the JSON lines in
# target/loadtest/faults.jsonl. Exits 1 when a run's slowest decision is over the bound.
#
#   bash scripts/fault-latency.sh
#   FAULTS="sigstop slow" MODES=direct KEYS=1 bash scripts/fault-latency.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RATE="${RATE:-20000}"
DURATION="${DURATION:-5}"
FAULTS="${FAULTS:-sigstop slow down restart}"
MODES="${MODES:-direct leased}"
KEYS="${KEYS:-1 10000}"
DELAY_MS="${DELAY_MS:-30}"
BOUND_MS=110
source scripts/lib.sh
tokenlease_bin
mkdir -p target/loadtest
out=target/loadtest/faults.jsonl
: >"$out"
echo "| fault | mode | keys | max ms | p99 ms | bound ms | fallback | served/s | what happened |"
echo "|---|---|---|---|---|---|---|---|---|"
over=0
for fault in $FAULTS; do
    for mode in $MODES; do
        for keys in $KEYS; do
            line="$(env -u DATABASE_URL "$bin" loadtest --mode "$mode" --instances 1 --tasks 512 \
                --keys "$keys" --rate "$RATE" --duration "$DURATION" --fault "$fault" \
                --fault-at 1 --fault-for 2 --fault-delay-ms "$DELAY_MS" --json 2>/dev/null)"
            echo "$line" >>"$out"
            row="$(BOUND_MS=$BOUND_MS python3 -c '
import json, os, sys
r = json.loads(sys.argv[1])
bound = float(os.environ["BOUND_MS"])
f = r["fault"]
name = f["kind"] + (" %d ms" % f["delay_ms"] if f.get("delay_ms") else "")
print("| %s | %s | %d | %.1f | %.1f | %.0f | %d | %.0f | %s |" % (name, r["mode"], r["keys"],
    r["max_us"] / 1000, r["p99_us"] / 1000, bound, r["fallback_decisions"],
    r["throughput_per_s"], f["outcome"]))
sys.exit(0 if r["max_us"] / 1000 <= bound else 3)
' "$line")" || { status=$?; [[ $status == 3 ]] || exit "$status"; over=1; }
            echo "$row"
        done
    done
done
echo
echo "JSON lines: $out"
if [[ $over == 1 ]]; then
    echo "a run's slowest decision was over the ${BOUND_MS} ms bound" >&2
    exit 1
fi
