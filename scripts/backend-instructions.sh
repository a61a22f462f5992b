#!/usr/bin/env bash
# The instructions the PostgreSQL backends execute per decision under the two real lone
# callers, counted by valgrind (callgrind, user space only: not the kernel's share of the
# network and the commit): a throwaway server runs under callgrind (fsync off), then
# rate-limiter-flexible's lone caller (Node, 1 in flight, synchronous_commit = off) and
# tokenlease's (direct mode, 1 task, call timeout 5 s: the server runs some 50 times slower),
# $D seconds each (15 by default), each on first touches and repeats of 10,000 keys. Each
# backend writes its profile when its session ends; a caller's figure is the sum over the
# backends that ended after it started (its connections, their start-up and prepares included)
# over its decisions. docs/results.md ("The one statement's cost on the server") has the figures.
# Run as root (the server runs as `postgres` through runuser).
#
#   TOKENLEASE=/path/to/tokenlease bash scripts/backend-instructions.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
D="${D:-15}"
source scripts/lib.sh
tokenlease_bin
[[ -d peers/node_modules/rate-limiter-flexible ]] || (cd peers && npm ci --no-audit --no-fund)
pg="${PG_BIN:-/usr/lib/postgresql/15/bin}"
tmp="$(mktemp -d)"
chmod 755 "$tmp"
chown postgres "$tmp"
mkdir "$tmp/cg"
chmod 777 "$tmp/cg"
runuser -u postgres -- "$pg/initdb" -D "$tmp/data" -A trust -U postgres --no-sync >/dev/null
port=$((20000 + RANDOM % 20000))
runuser -u postgres -- valgrind --tool=callgrind --callgrind-out-file="$tmp/cg/%p.cg" \
    "$pg/postgres" -D "$tmp/data" -p "$port" -k "$tmp" -c listen_addresses=127.0.0.1 \
    -c fsync=off >"$tmp/log" 2>&1 &
cleanup() {
    runuser -u postgres -- "$pg/pg_ctl" -D "$tmp/data" -m immediate stop >/dev/null 2>&1
    rm -rf "$tmp"
}
trap cleanup EXIT
for _ in $(seq 1 120); do
    psql "host=$tmp port=$port user=postgres dbname=postgres" -XAtc 'SELECT 1' >/dev/null 2>&1 && break
    sleep 1
done
url="postgres://postgres@127.0.0.1:$port/postgres"
"$bin" migrate --database-url "$url" >/dev/null || exit 1
per_decision() { # LABEL SINCE DECISIONS
    python3 - "$tmp/cg" "$@" <<'PY'
import os, re, sys
d, label, since, decisions = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
total = backends = 0
for f in os.listdir(d):
    p = os.path.join(d, f)
    if os.path.getmtime(p) < since:
        continue
    m = re.search(r"^(?:summary|totals): (\d+)", open(p).read(), re.M)
    if m:
        total, backends = total + int(m.group(1)), backends + 1
print(f"{label}: {decisions} decisions, {backends} backends, {total / decisions:,.0f} instructions a decision")
PY
}
since="$(date +%s.%N)"
PGOPTIONS="-c synchronous_commit=off" node peers/rlf-postgres.js --url "$url" --keys 10000 \
    --concurrency 1 --pool 1 --duration "$D" >"$tmp/peer.json" 2>/dev/null
sleep 3 # the backend's profile is written as its session ends
per_decision "rate-limiter-flexible, 1 in flight" "$since" \
    "$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["allowed"] + r["denied"])' "$tmp/peer.json")"
since="$(date +%s.%N)"
"$bin" loadtest --database-url "$url" --json --instances 1 --tasks 1 --duration "$D" \
    --mode direct --keys 10000 --rate 1000000 --call-timeout-ms 5000 >"$tmp/ours.json" 2>/dev/null
sleep 3
per_decision "tokenlease direct, 1 task" "$since" \
    "$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["admitted"] + r.get("denied", 0))' "$tmp/ours.json")"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("tokenlease fallback decisions:", r.get("fallback_decisions"))' "$tmp/ours.json"
