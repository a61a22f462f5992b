#!/usr/bin/env bash
# Instructions per request of each set-up of the HTTP bench (benches/http.rs), counted by
# valgrind (callgrind), where the bench's timings on a shared 2-core machine move by ±15 ns from
# run to run and by as much again between two builds of the same code (code layout). Measured
# (2026-12-07): a tokenlease set-up's figure is the same to the instruction in two runs of one
# binary and within ±40 between two builds of the same code; governor's moves by up to ±200 (its
# clock and its map's random hashing), so compare this layer's builds with each other and
# governor's figure only roughly. What instructions leave out (atomic operations, cache misses,
# stalls) only timing shows: a change of fewer than about 50 instructions is no change.
#
#   bash scripts/http-instructions.sh                  # every set-up
#   SETUPS="bare governor_1_limit" bash scripts/http-instructions.sh
#   BIN=/tmp/http-old bash scripts/http-instructions.sh # a bench binary built before
#
# Each set-up runs alone (`TOKENLEASE_BENCH_ONLY`) under callgrind twice, with 1 and with 3 rounds
# of 20,000 requests (`TOKENLEASE_BENCH_ROUNDS`); the difference over 40,000 requests is the
# figure: the request built, routed, checked and answered, without the process's start, the
# set-up and the warm-up. What a layer costs is its figure less `bare`'s.
#
# At 1 booking id only: under valgrind a request takes some fifty times as long, so over 10,000
# ids each key's lease outlives its time-to-live between two of its requests and every request
# would count a refill that the bench at full speed never makes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v valgrind >/dev/null || { echo "http-instructions: valgrind is not on PATH (apt-get install valgrind)" >&2; exit 1; }
SETUPS="${SETUPS:-bare passthrough governor_1_limit governor_1_limit_headers tokenlease_1_limit tokenlease_2_limits tokenlease_2_limits_on_refusals tokenlease_code_2_limits_on_refusals}"
if [[ -z "${BIN:-}" ]]; then
  BIN=$(cargo bench --bench http --all-features --no-run 2>&1 \
    | sed -n 's/.*Executable benches\/http.rs (\(.*\))/\1/p' | tail -1)
  [[ -n "$BIN" ]] || { echo "http-instructions: the bench did not build" >&2; exit 1; }
fi

# Instructions of one run of `$1` rounds of set-up `$2`.
count() {
  TOKENLEASE_BENCH_INTERLEAVED=1 TOKENLEASE_BENCH_ONLY="$2" TOKENLEASE_BENCH_IDS=1 \
    TOKENLEASE_BENCH_ROUNDS="$1" valgrind --tool=callgrind --callgrind-out-file=/dev/null \
    "$BIN" --bench 2>&1 >/dev/null | sed -n 's/.*I *refs: *\([0-9,]*\).*/\1/p' | tr -d ,
}

echo "instructions per request, 1 id, $(basename "$BIN"):"
echo "| set-up | instructions | over bare |"
echo "|---|---|---|"
bare=""
for s in $SETUPS; do
  one=$(count 1 "$s")
  three=$(count 3 "$s")
  [[ -n "$one" && -n "$three" ]] || { echo "http-instructions: no count for $s" >&2; exit 1; }
  per=$(( (three - one) / 40000 ))
  [[ "$s" == bare ]] && bare=$per
  echo "| $s | $per | ${bare:+$(( per - bare ))} |"
done
