#!/usr/bin/env bash
# Counts the public items reachable from the `tokenlease` crate's root, from rustdoc's HTML, and
# fails when there are more than the limit ($1, default 160). Run after
# `cargo doc --no-deps --all-features` (stable rustdoc; .ci/run runs it after its doc step).
#
# What is counted: every named item a user can write a path to, as rustdoc lists it in
# target/doc/tokenlease/all.html (structs, enums, unions, traits, functions, type aliases,
# constants, statics, macros: one link each), plus the public modules (each directory of the
# crate's rustdoc output holding a module page, index.html; the root not counted). Methods,
# associated constants and types, fields and enum variants are not counted: they belong to
# their type and are listed on its page. `#[doc(hidden)]` items are not listed by rustdoc, so
# not counted. An item re-exported at several paths has one page and counts once.
set -euo pipefail

limit="${1:-160}"
root="${CARGO_TARGET_DIR:-target}/doc/tokenlease"
if [[ ! -f "$root/all.html" ]]; then
    echo "no $root/all.html: run cargo doc --no-deps --all-features first" >&2
    exit 2
fi
# One link per item, e.g. <li><a href="store/struct.MemoryStore.html">; the section links of
# the page's top (href="#structs") do not match.
items="$(grep -oE '<li><a href="[a-z0-9_/]*[a-z]+\.[A-Za-z0-9_]+\.html">' "$root/all.html" | sort -u)"
item_count="$(printf '%s\n' "$items" | grep -c . || true)"
modules="$(cd "$root" && find . -mindepth 2 -name index.html | sed -e 's|^\./||' -e 's|/index\.html$||' -e 's|/|::|g' | sort)"
module_count="$(printf '%s\n' "$modules" | grep -c . || true)"
by_kind="$(printf '%s\n' "$items" | sed -E 's|.*href="([a-z0-9_]+/)*([a-z]+)\..*|\2|' \
    | sort | uniq -c | awk '{printf "%s%d %s", sep, $1, $2; sep=", "}')"
total=$((item_count + module_count))
echo "public items of tokenlease: $total ($by_kind; $module_count modules: $(echo $modules)); limit $limit"
if ((total > limit)); then
    echo "more public items than $limit: cut the surface, or change the limit in docs/design/public-api.md and .ci/run together" >&2
    exit 1
fi
