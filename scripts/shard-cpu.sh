#!/usr/bin/env bash
# How busy the machine's CPUs are while `tokenlease loadtest --shards S` runs, for S = 1 and 3
# (or the counts given), alternated: is the statement rate of several throwaway clusters limited
# by the cores they share with each other and with the load generator?
#
# Each run is `tokenlease loadtest --mode direct --keys $KEYS --instances 1 --tasks $TASKS
# --rate 100000 --duration $DURATION_S --shards S --pool $POOL --json` (the release build;
# `--pool`, 4 by default, is per shard). /proc/stat's
# `cpu` line is read when the run's first progress line appears on stderr (the clusters are up
# and the load has run a second) and again at each later one, so the figures cover the load
# alone, not the clusters' start and stop. Busy is every jiffy that is not idle or iowait;
# steal (time the hypervisor gave to other guests) is shown on its own and counted as busy.
# iowait is shown on its own (counted as idle); "client" is the loadtest process's own share of
# the machine (the limiter and the load generator; the rest of "busy" is the PostgreSQL
# servers and anything else running). "busy before" is the busy figure over the 2 s before each
# run: other work on the machine. Shares are of all cores together (100% = every core busy).
# Prints one table row per run; the JSON reports go to $OUT (target/shard-cpu/results.jsonl).
#
#   bash scripts/shard-cpu.sh                 # 1 and 3 shards, twice each, 64 callers
#   TASKS=16 REPEAT=1 bash scripts/shard-cpu.sh 1 2 3
#   POOL=12 REPEAT=1 bash scripts/shard-cpu.sh 1    # one cluster, as many connections as 3 × 4
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KEYS="${KEYS:-100000}"
TASKS="${TASKS:-64}"
DURATION_S="${DURATION_S:-10}"
POOL="${POOL:-4}"
REPEAT="${REPEAT:-2}"
counts=("$@")
[[ ${#counts[@]} -gt 0 ]] || counts=(1 3)
target="${CARGO_TARGET_DIR:-target}"
source scripts/lib.sh
tokenlease_bin
OUT="${OUT:-$target/shard-cpu/results.jsonl}"
mkdir -p "$(dirname "$OUT")"

# The `cpu` line's jiffies: "busy idle steal total iowait" (busy includes steal; idle includes
# iowait), then the loadtest process's own user + system ticks ($1, the same unit).
cpu_jiffies() {
    awk '/^cpu / {
        idle = $5 + $6; total = 0
        for (i = 2; i <= NF; i++) total += $i
        steal = (NF >= 9) ? $9 : 0
        printf "%d %d %d %d %d", total - idle, idle, steal, total, $6
    }' /proc/stat
    # Fields after the parenthesised command name: utime and stime are the 12th and 13th.
    if [[ -n "${1:-}" && -r /proc/$1/stat ]]; then
        sed 's/^.*) //' "/proc/$1/stat" | awk '{ printf " %d\n", $12 + $13 }'
    else
        echo " 0"
    fi
}

echo "cores: $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
printf '%-6s %-6s %12s %14s %28s %10s %8s %8s %8s %7s %12s\n' \
    shards callers requests/s statements/s "per shard" "cpu busy" steal iowait client load-s \
    "busy before"
for ((round = 0; round < REPEAT; round++)); do
    for shards in "${counts[@]}"; do
        # What the machine does without the run (other work on it): 2 s before.
        read -r _ ib0 _ _ in0 _ <<<"0 $(cpu_jiffies)"
        sleep 2
        read -r _ ib1 _ _ in1 _ <<<"0 $(cpu_jiffies)"
        before=$(awk -v b="$((ib1 - ib0))" -v n="$((in1 - in0))" 'BEGIN { printf "%.1f", 100 * b / (n > 0 ? n : 1) }')
        fifo=$(mktemp -u) && mkfifo "$fifo"
        out=$(mktemp)
        "$bin" loadtest --mode direct --keys "$KEYS" --instances 1 --tasks "$TASKS" \
            --rate 100000 --duration "$DURATION_S" --shards "$shards" --pool "$POOL" --json \
            >"$out" 2>"$fifo" &
        pid=$!
        first="" last=""
        # Until the run closes its stderr (it exits).
        while IFS= read -r line; do
            case "$line" in
            "loadtest: "*"(done)"*) ;;
            "loadtest: "*)
                last="$(date +%s.%N) $(cpu_jiffies "$pid")"
                [[ -n "$first" ]] || first="$last"
                ;;
            *) echo "$line" >&2 ;;
            esac
        done <"$fifo"
        wait "$pid"
        report=$(cat "$out")
        rm -f "$fifo" "$out"
        echo "$report" >>"$OUT"
        read -r t0 b0 _ s0 n0 w0 c0 <<<"$first"
        read -r t1 b1 _ s1 n1 w1 c1 <<<"$last"
        python3 - "$report" "$t0" "$b0" "$s0" "$n0" "$w0" "$c0" \
            "$t1" "$b1" "$s1" "$n1" "$w1" "$c1" "$before" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
t0, b0, s0, n0, w0, c0, t1, b1, s1, n1, w1, c1, before = map(float, sys.argv[2:])
total = max(n1 - n0, 1.0)
per_shard = ", ".join(f"{x:.0f}" for x in r["shard_db_calls_per_s"])
print(f"{len(r['shard_db_calls']):<6} {r['tasks']:<6} {r['throughput_per_s']:>12,.0f} "
      f"{r['db_calls_per_s']:>14,.0f} {per_shard:>28} {100 * (b1 - b0) / total:>9.1f}% "
      f"{100 * (s1 - s0) / total:>7.1f}% {100 * (w1 - w0) / total:>7.1f}% "
      f"{100 * (c1 - c0) / total:>7.1f}% {t1 - t0:>7.1f} {before:>11.1f}%")
EOF
    done
done
