#!/usr/bin/env bash
# A flood of $KEYS distinct entity ids (1,000,000 by default) through a release build of
# `tokenlease demo` with its database down, then a tenth as many with it up: prints the demo's
# RSS at the start, at its peak, when it came back within 10 MiB of the start and a minute after
# the flood (cli/tests/flood.rs explains the set-up). The entity plan refills 150 tokens an hour
# here, so a flood's local bucket is full again 48 s after its one call; CI runs the same test
# with 120,000 ids in a debug build, a plan whose token takes 30 s and no minute-long watch.
#
#   bash scripts/flood-rss.sh
#   KEYS=300000 bash scripts/flood-rss.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TOKENLEASE_FLOOD_KEYS="${KEYS:-1000000}" TOKENLEASE_FLOOD_PERIOD_S=3600 TOKENLEASE_FLOOD_WATCH_S=60 \
    cargo test --release -p tokenlease-cli --test cli -- flood:: --nocapture 2>&1 \
    | grep -E "^flood of|test result|panicked"
