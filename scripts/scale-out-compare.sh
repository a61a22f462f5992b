#!/usr/bin/env bash
# Does spreading the keys over several stores keep statements full? `tokenlease loadtest`, one
# instance of 16 tasks, over one throwaway primary, over two (`--shards 2`, ShardedStore) and
# over a throwaway Citus cluster of two workers (`--citus 2`), back to back in one run:
#
#   direct:  --mode direct --keys 10000 (the default pace, 20,000 requests/s)
#   direct4: the same with 4 calls in flight per task (--in-flight 4 --rate 40000): 64 callers,
#            enough to fill each shard's statements (16 callers fill one primary's, but only
#            half of each of two shards')
#   leased:  --mode leased --keys 100000 --rate 100000 (most calls a key's first: refills)
#
# each for $DURATION_S seconds (10 by default) with the server's CPU read after $WARMUP_S (3):
# the first calls of many keys each write a row, which a long run writes once. Prints one row
# per run: decisions/s, statements per 1,000 decisions, decisions per statement, the server's
# CPU µs per decision (every cluster summed), p99 and the fallback's decisions (and their share),
# then the medians over the rounds and each set-up's ratios to the one primary.
# With BEFORE set to another build's binary (e.g. the main branch's), every set-up runs with it
# and with this one back to back (the other one first in every other round, with REPEAT=2 or
# more), so a busy machine weighs on both alike. The JSON
# reports go to $OUT.
#
#   bash scripts/scale-out-compare.sh
#   BEFORE=/path/to/old/tokenlease REPEAT=2 bash scripts/scale-out-compare.sh
#   TOKENLEASE=/path/to/tokenlease DURATION_S=5 WARMUP_S=2 bash scripts/scale-out-compare.sh
#   MODES="direct leased" bash scripts/scale-out-compare.sh   # some of the modes only
#   SETUPS="shards1" BEFORE=... bash scripts/scale-out-compare.sh   # one primary only: a
#       change's cost per decision before and after, without the scale-out set-ups
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DURATION_S="${DURATION_S:-10}"
WARMUP_S="${WARMUP_S:-3}"
REPEAT="${REPEAT:-1}"
MODES="${MODES:-direct direct4 leased}"
SETUPS="${SETUPS:-shards1 shards2 citus2}"
BEFORE="${BEFORE:-}"
target="${CARGO_TARGET_DIR:-target}"
source scripts/lib.sh
tokenlease_bin
OUT="${OUT:-$target/scale-out-compare/results.jsonl}"
mkdir -p "$(dirname "$OUT")"

# One table row from a report (in $JSON; the build, mode and set-up in $WHO, $MODE, $SETUP).
read -r -d '' ROW <<'PY' || true
import json, os
r = json.loads(os.environ["JSON"])
cpu = r.get("server_cpu_us_per_decision")
decisions = max(r["throughput_per_s"] * r["duration_s"], 1)
fallback = r["fallback_decisions"]
print("%-7s %-7s %-10s %11.0f %10.1f %9.2f %11.1f %8.1f %8d (%.3f%%)" % (
    os.environ["WHO"], os.environ["MODE"], os.environ["SETUP"], r["throughput_per_s"],
    r["db_calls_per_1k"], r["decisions_per_statement"],
    cpu if cpu is not None else float("nan"), r["p99_us"] / 1000, fallback,
    100.0 * fallback / decisions))
PY

builds=("after=$bin")
[[ -n "$BEFORE" ]] && builds=("before=$BEFORE" "after=$bin")

# This run's reports, one per line (build, mode, set-up, JSON), for the medians at the end.
rows="$(mktemp)"
trap 'rm -f "$rows"' EXIT

echo "cores: $(nproc); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-7s %-7s %-10s %11s %10s %9s %11s %8s %s\n' build mode set-up decisions/s \
    "stmts/1k" "dec/stmt" "CPU µs/dec" "p99 ms" fallback
for ((round = 0; round < REPEAT; round++)); do
    for mode in $MODES; do
        case "$mode" in
            direct) load=(--mode direct --keys 10000) ;;
            direct4) load=(--mode direct --keys 10000 --in-flight 4 --rate 40000) ;;
            leased) load=(--mode leased --keys 100000 --rate 100000) ;;
        esac
        for name in $SETUPS; do
            case "$name" in
                shards1) setup="--shards 1" ;;
                shards2) setup="--shards 2" ;;
                citus2) setup="--citus 2" ;;
                *) echo "scale-out-compare: unknown set-up $name (shards1, shards2, citus2)" >&2; exit 2 ;;
            esac
            # Every other round the other build first: the second of two runs back to back
            # may find the machine busier (the first's cluster still being removed).
            order=("${builds[@]}")
            if ((round % 2 == 1 && ${#builds[@]} == 2)); then
                order=("${builds[1]}" "${builds[0]}")
            fi
            for build in "${order[@]}"; do
                # shellcheck disable=SC2086
                json="$("${build#*=}" loadtest "${load[@]}" --instances 1 --tasks 16 \
                    --duration "$DURATION_S" --warmup "$WARMUP_S" --json $setup 2>/dev/null)"
                echo "$json" >>"$OUT"
                printf '%s\t%s\t%s\t%s\n' "${build%%=*}" "$mode" "${setup#--}" "$json" >>"$rows"
                WHO="${build%%=*}" MODE="$mode" SETUP="${setup#--}" JSON="$json" \
                    python3 -c "$ROW"
            done
        done
    done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"

# Medians over the rounds, and each set-up against the one primary (`shards 1`) of the same
# build and mode: the ratios the scale-out targets are stated in.
ROWS="$rows" python3 - <<'PY'
import json, os, statistics
runs = {}
for line in open(os.environ["ROWS"]):
    who, mode, setup, js = line.rstrip("\n").split("\t", 3)
    r = json.loads(js)
    cpu = r.get("server_cpu_us_per_decision")
    decisions = max(r["throughput_per_s"] * r["duration_s"], 1)
    runs.setdefault((who, mode, setup), []).append(
        (r["db_calls_per_1k"], cpu if cpu is not None else float("nan"), r["p99_us"] / 1000,
         100.0 * r["fallback_decisions"] / decisions))
print()
print("medians over %d round(s); ratios against the same build's one primary" %
      max(len(v) for v in runs.values()))
print("%-7s %-7s %-10s %10s %11s %8s %10s %13s %11s" % ("build", "mode", "set-up", "stmts/1k",
      "CPU µs/dec", "p99 ms", "fallback%", "stmts ratio", "CPU ratio"))
med = lambda xs: statistics.median(xs)
for (who, mode, setup), v in runs.items():
    s, c, p, f = (med([x[i] for x in v]) for i in range(4))
    base = runs.get((who, mode, "shards 1"))
    bs, bc = (med([x[0] for x in base]), med([x[1] for x in base])) if base else (s, c)
    print("%-7s %-7s %-10s %10.1f %11.1f %8.1f %10.3f %12.2fx %10.2fx" % (
        who, mode, setup, s, c, p, f, s / bs, c / bc))
PY
