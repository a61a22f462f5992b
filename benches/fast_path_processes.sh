#!/usr/bin/env bash
# The keyed fast path against governor, repeated in N separate processes (default 10).
#
# The 100,000-key figures move a lot from one process to the next on a shared VM (governor's own
# went from 54 to 177 ns between processes of one binary), so one run's ratio says little. This
# runs the 1-key and 100,000-key pairs of `cargo bench --bench lease` (criterion, 1 s warm-up,
# 3 s measurement) once per process and prints each process's ratios (governor ÷ tokenlease,
# above 1 means tokenlease is faster), then the median and the range.
#
# Usage: bash benches/fast_path_processes.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-10}
cargo bench --bench lease --no-run >/dev/null 2>&1
filter='fast_path/(tokenlease/1_key|tokenlease/100k_keys|governor_keyed/1_key|governor_keyed/100k_keys)$'
ratios=$(mktemp)
trap 'rm -f "$ratios"' EXIT
echo "| process | tokenlease 1 key (ns) | governor 1 key (ns) | ratio | tokenlease 100k keys (ns) | governor 100k keys (ns) | ratio |"
echo "|---|---|---|---|---|---|---|"
for i in $(seq 1 "$n"); do
  TOKENLEASE_BENCH_CRITERION_ONLY=1 cargo bench --bench lease -- \
      --warm-up-time 1 --measurement-time 3 --noplot "$filter" 2>/dev/null |
    awk -v i="$i" '
      /^fast_path\// { name = $1 }
      /time:/ && name != "" {
        v = $4; u = $5
        if (u == "µs") v *= 1000
        t[name] = v; name = ""
      }
      END {
        a = t["fast_path/tokenlease/1_key"]; b = t["fast_path/governor_keyed/1_key"]
        c = t["fast_path/tokenlease/100k_keys"]; d = t["fast_path/governor_keyed/100k_keys"]
        printf "| %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f |\n", i, a, b, b / a, c, d, d / c
      }' | tee -a "$ratios"
done
summary() {
  # $1: the column of the ratio (awk field number in a table row split on "|").
  awk -F'|' -v col="$1" '{ gsub(/ /, "", $col); print $col }' "$ratios" | sort -n |
    awk '{ r[NR] = $1 } END {
      m = (NR % 2) ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2
      printf "median %.2f, range %.2f to %.2f, %d of %d processes at or above 1.00\n", m, r[1], r[NR], above, NR
    } $1 >= 1.0 { above++ }'
}
echo
echo "1 key, governor ÷ tokenlease: $(summary 5)"
echo "100,000 keys, governor ÷ tokenlease: $(summary 8)"
