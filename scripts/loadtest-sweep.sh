#!/usr/bin/env bash
# Runs the `tokenlease loadtest` configurations behind README.md's results table and prints the
# table (markdown) and the raw JSON lines. Every run is 2 instances × 16 tasks at 20,000
# requests/s in total for $DURATION seconds, against one throwaway PostgreSQL (or DATABASE_URL).
# The JSON lines are kept in target/loadtest/results.jsonl, and `tokenlease chart` draws
# docs/loadtest-chart.png from them (needs DejaVu Sans: Debian package fonts-dejavu-core).
# docs/loadtest.md explains every option and field.
#
#   bash scripts/loadtest-sweep.sh            # DURATION=20 by default
#   DURATION=5 bash scripts/loadtest-sweep.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DURATION="${DURATION:-20}"
cargo build --release --quiet
bin=target/release/tokenlease
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
# Strict accounting (DESIGN.md §13): leases counted against the capacity, no overshoot term.
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
print("| keys | mode | lease | requests | db calls / 1k | admitted / ideal | overshoot (bound) | fallback decisions | throughput /s | p50 µs | p99 µs | p99.9 µs |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    keys = "1 hot" if r["keys"] == 1 else f'{r["keys"]:,} {r["dist"]}'
    if r.get("pattern") == "lull-burst":
        keys += ", lull-burst"
    lease = "–" if r["lease_fraction"] is None else f'{r["lease_fraction"]:g} × C, {r.get("accounting") or "relaxed"}'
    print(f'| {keys} (C={r["capacity"]}, r={r["refill_per_second"]:g}/s) | {r["mode"]} | {lease} | {r["requests"]:,} '
          f'| {r["db_calls_per_1k"]:.2f} | {r["admitted"]:,} / {r["ideal_admitted"]:,} ({100*r["admitted_vs_ideal"]:.1f}%) '
          f'| {r["overshoot_tokens"]:.2f} ({r["overshoot_bound"]:g}) | {r["fallback_decisions"]:,} | {r["throughput_per_s"]:,.0f} '
          f'| {r["p50_us"]:.1f} | {r["p99_us"]:.1f} | {r["p999_us"]:.1f} |')
PY
echo
echo "results: $out"
"$bin" chart --input "$out" --output docs/loadtest-chart.png
