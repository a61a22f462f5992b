#!/usr/bin/env bash
# Two sweeps of `tokenlease loadtest`, against throwaway PostgreSQL clusters (or DATABASE_URL).
# docs/loadtest.md explains every option and field.
#
# `leases` (the default): the configurations behind README.md's results table. Every run is
# 2 instances × 16 tasks at 20,000 requests/s in total for $DURATION seconds (20 by default).
# Prints the table (markdown) and the raw JSON lines, keeps them in
# target/loadtest/results.jsonl, and `tokenlease chart` draws docs/loadtest-chart.png from them
# (needs DejaVu Sans: Debian package fonts-dejavu-core).
#
# `bands`: cost and latency by per-key request rate. At a fixed total of $TOTAL_RATE requests/s
# (5,000 by default) over 2 instances × 16 tasks, the keys are TOTAL_RATE / band for each band of
# $BANDS requests/s per key (0.1 1 3 10 100: 50,000 keys down to 50), each in direct and leased
# mode, $DURATION seconds a run (10 by default). Prints a table (band, mode, requests/s served,
# statements per 1,000 requests, p50/p99/max latency, admitted vs ideal, fallback decisions,
# requests not sent), keeps target/loadtest/bands.jsonl (the loadtest reports, each with
# `band_per_key_rate` added) and target/loadtest/bands.csv, and `tokenlease chart --bands` draws
# docs/loadtest-bands.png from them.
#
#   bash scripts/loadtest-sweep.sh                    # leases, DURATION=20
#   DURATION=5 bash scripts/loadtest-sweep.sh
#   bash scripts/loadtest-sweep.sh bands              # 10 runs of 10 s
#   DURATION=3 BANDS="1 100" bash scripts/loadtest-sweep.sh bands
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SWEEP="${1:-leases}"
case "$SWEEP" in
leases | bands) ;;
*)
    echo "usage: bash scripts/loadtest-sweep.sh [leases|bands]  (got '$SWEEP')" >&2
    exit 2
    ;;
esac
source scripts/lib.sh
tokenlease_bin

if [[ "$SWEEP" == bands ]]; then
    DURATION="${DURATION:-10}"
    TOTAL_RATE="${TOTAL_RATE:-5000}"
    BANDS="${BANDS:-0.1 1 3 10 100}"
    out=target/loadtest/bands.jsonl
    mkdir -p "$(dirname "$out")"
    : >"$out"
    for band in $BANDS; do
        keys="$(python3 -c "import sys; print(max(1, round(float(sys.argv[1]) / float(sys.argv[2]))))" "$TOTAL_RATE" "$band")"
        for mode in direct leased; do
            echo "loadtest --mode $mode --keys $keys --rate $TOTAL_RATE --duration $DURATION  ($band/s per key)" >&2
            "$bin" loadtest --json --mode "$mode" --keys "$keys" --rate "$TOTAL_RATE" \
                --duration "$DURATION" |
                python3 -c 'import json, sys; r = json.loads(sys.stdin.read()); r["band_per_key_rate"] = float(sys.argv[1]); print(json.dumps(r))' "$band" |
                tee -a "$out"
        done
    done
    echo
    python3 - "$out" "${out%.jsonl}.csv" <<'PY'
import csv, json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
cols = ["band_per_key_rate", "keys", "mode", "rate_per_s", "throughput_per_s", "db_calls_per_1k",
        "p50_us", "p99_us", "p999_us", "max_us", "admitted", "ideal_admitted", "admitted_vs_ideal",
        "fallback_decisions", "requests", "unsent", "in_flight_at_end", "duration_s"]
with open(sys.argv[2], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(cols)
    for r in rows:
        w.writerow([r[c] for c in cols])
print("| requests/s per key | keys | mode | offered /s | served /s | statements / 1k | p50 µs | p99 µs | max µs | admitted / ideal | fallback | unsent |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f'| {r["band_per_key_rate"]:g} | {r["keys"]:,} | {r["mode"]} | {r["rate_per_s"]:,.0f} | {r["throughput_per_s"]:,.0f} '
          f'| {r["db_calls_per_1k"]:.1f} | {r["p50_us"]:,.1f} | {r["p99_us"]:,.1f} | {r["max_us"]:,.1f} '
          f'| {r["admitted"]:,} / {r["ideal_admitted"]:,} ({100 * r["admitted_vs_ideal"]:.1f}%) '
          f'| {r["fallback_decisions"]:,} | {r["unsent"]:,} |')
PY
    echo
    echo "results: $out and ${out%.jsonl}.csv"
    "$bin" chart --bands "$out" --output docs/loadtest-bands.png
    exit 0
fi

DURATION="${DURATION:-20}"
out=target/loadtest/results.jsonl
mkdir -p "$(dirname "$out")"
: >"$out"
run() {
    echo "loadtest $*" >&2
    "$bin" loadtest --duration "$DURATION" --json "$@" | tee -a "$out"
}
# One hot key: direct, then leases of 2%, 5%, 10% and 20% of the capacity.
run --mode direct
for f in 0.02 0.05 0.1 0.2; do run --mode leased --lease-fraction "$f"; done
# Strict accounting (docs/design/strict-accounting.md): leases counted against the capacity, no overshoot term.
run --mode leased --accounting strict
# One hot key, lull-burst: steady demand under the rate, an idle 2.5 s, a burst; leases live 5 s
# and hold 500 ms of demand, so they are still out when the bucket has refilled. Relaxed leases
# overshoot here (within their bound); strict ones must not.
run --mode direct --pattern lull-burst
run --mode leased --pattern lull-burst --lease-ttl-ms 5000 --refresh-ms 500
run --mode leased --pattern lull-burst --lease-ttl-ms 5000 --refresh-ms 500 --accounting strict
# 10,000 keys, uniform (each key quiet: 2 requests/s against a refill of 50/s).
run --mode direct --keys 10000
run --mode leased --keys 10000
run --mode leased --keys 10000 --accounting strict
# 1,000 keys, Zipf: a few hot keys and a long quiet tail, with a tighter bucket.
run --mode direct --keys 1000 --dist zipf --capacity 20 --refill 10
run --mode leased --keys 1000 --dist zipf --capacity 20 --refill 10
run --mode leased --keys 1000 --dist zipf --capacity 20 --refill 10 --accounting strict
echo
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| keys | mode | lease | requests | db calls / 1k | admitted / ideal | overshoot (bound) | fallback decisions | throughput /s | p50 µs | p99 µs | p99.9 µs | max µs |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    keys = "1 hot" if r["keys"] == 1 else f'{r["keys"]:,} {r["dist"]}'
    if r.get("pattern") == "lull-burst":
        keys += ", lull-burst"
    lease = "–" if r["lease_fraction"] is None else f'{r["lease_fraction"]:g} × C, {r.get("accounting") or "relaxed"}'
    print(f'| {keys} (C={r["capacity"]}, r={r["refill_per_second"]:g}/s) | {r["mode"]} | {lease} | {r["requests"]:,} '
          f'| {r["db_calls_per_1k"]:.2f} | {r["admitted"]:,} / {r["ideal_admitted"]:,} ({100*r["admitted_vs_ideal"]:.1f}%) '
          f'| {r["overshoot_tokens"]:.2f} ({r["overshoot_bound"]:g}) | {r["fallback_decisions"]:,} | {r["throughput_per_s"]:,.0f} '
          f'| {r["p50_us"]:.1f} | {r["p99_us"]:.1f} | {r["p999_us"]:.1f} | {r.get("max_us", float("nan")):.1f} |')
PY
echo
echo "results: $out"
"$bin" chart --input "$out" --output docs/loadtest-chart.png
