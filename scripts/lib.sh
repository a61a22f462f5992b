# Shared by the measurement scripts in this directory: sourced (after `cd` to the repository's
# root), not run.

# Sets `bin` to the `tokenlease` binary: $TOKENLEASE when set (a prebuilt binary, e.g. another
# commit's, for a before/after), otherwise the release build of the tokenlease-cli crate.
tokenlease_bin() {
    if [[ -n "${TOKENLEASE:-}" ]]; then
        bin="$TOKENLEASE"
    else
        cargo build --release --quiet -p tokenlease-cli --bin tokenlease
        bin="${CARGO_TARGET_DIR:-target}/release/tokenlease"
    fi
}

# Starts `$bin loadtest --serve-db`, a migrated throwaway PostgreSQL that lives until the
# process is stopped, with its output in "$tmp"; sets `serve_pid` and `url` once it serves.
# Exits naming $1 (the calling script) when it does not start within a minute. The caller's
# EXIT trap stops `serve_pid`.
serve_db() {
    "$bin" loadtest --serve-db >"$tmp/url" 2>"$tmp/serve.log" &
    serve_pid=$!
    for _ in $(seq 1 120); do
        [[ -s "$tmp/url" ]] && break
        kill -0 "$serve_pid" 2>/dev/null || { cat "$tmp/serve.log" >&2; exit 1; }
        sleep 0.5
    done
    url="$(head -n 1 "$tmp/url")"
    [[ -n "$url" ]] || {
        echo "$1: the throwaway PostgreSQL did not start" >&2
        cat "$tmp/serve.log" >&2
        exit 1
    }
}
