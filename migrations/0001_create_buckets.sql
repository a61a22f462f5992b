-- One row per rate-limit key: the token bucket as of its last refill.
--
-- Why these choices:
-- * Logged (not UNLOGGED): an UNLOGGED table comes back empty after a crash, which would refill
--   every bucket at once. Rate-limit state is soft, but not that soft.
-- * numeric(38, 18): tokens are exact fixed-point decimals with eighteen fraction digits (20
--   integer digits hold u64::MAX), the same scale as the library's in-memory `Tokens`, so the
--   SQL and the pure bucket agree exactly.
-- * The policy (capacity, refill rate) is stored on the row so the row alone explains itself to
--   an operator (`tokenlease inspect`), and a changed policy takes effect on the next call.
-- * CHECK constraints bound every number from both sides: in PostgreSQL 'NaN' compares greater
--   than every number, so `x > 0` alone lets NaN through, and a NaN refill rate would make a
--   bucket that never denies. An upper bound refuses NaN and Infinity together; the explicit
--   `<> 'NaN'` says so to the reader.
-- * updated_at is the database's own clock (now()), never an application clock.
CREATE TABLE IF NOT EXISTS tokenlease_buckets (
    key               text           PRIMARY KEY,
    tokens            numeric(38, 18) NOT NULL,
    capacity          numeric(38, 18) NOT NULL,
    refill_per_second numeric(38, 18) NOT NULL,
    updated_at        timestamptz    NOT NULL,
    last_granted      numeric(38, 18) NOT NULL DEFAULT 0,
    CONSTRAINT tokenlease_buckets_capacity_range
        CHECK (capacity <> 'NaN' AND capacity > 0 AND capacity <= 18446744073709551615),
    CONSTRAINT tokenlease_buckets_rate_range
        CHECK (refill_per_second <> 'NaN' AND refill_per_second > 0
               AND refill_per_second <= 1000000000),
    CONSTRAINT tokenlease_buckets_tokens_range
        CHECK (tokens <> 'NaN' AND tokens >= 0 AND tokens <= capacity),
    CONSTRAINT tokenlease_buckets_last_granted_range
        CHECK (last_granted <> 'NaN' AND last_granted >= 0 AND last_granted <= capacity),
    CONSTRAINT tokenlease_buckets_updated_at_finite
        CHECK (isfinite(updated_at))
);

COMMENT ON TABLE tokenlease_buckets IS
    'tokenlease token buckets: tokens as of updated_at (database time); an absent row is a full bucket';
COMMENT ON COLUMN tokenlease_buckets.last_granted IS
    'tokens granted by the most recent acquire statement, so RETURNING can report the grant';

-- The refill, written once: tokens at `at` for a bucket that held `tokens` at `updated_at`:
-- elapsed seconds × rate, capped at capacity. Elapsed time has six fraction digits (microseconds)
-- and the rate nine (whole nanotokens per second), so the product is exact in numeric and fits
-- the eighteen-digit scale: no rounding, no drift. A negative elapsed time (a clock that went
-- backwards, or a refill time in the future) refills nothing. This is exactly the arithmetic of
-- the library's pure bucket (src/bucket/math.rs). IMMUTABLE with an immutable body
-- (timestamptz - timestamptz, extract from an interval), so the planner inlines it.
CREATE OR REPLACE FUNCTION tokenlease_refill(
    tokens numeric, capacity numeric, rate numeric, updated_at timestamptz, at timestamptz
) RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN least(capacity, tokens + greatest(0, extract(epoch FROM (at - updated_at))) * rate);

-- What a bucket holding `available` tokens grants for a request (min, want, step): the largest
-- multiple of `step` that is at most `want` and at most `available`, if that reaches `min`;
-- otherwise 0. The library's AcquireRequest::grantable computes the same. The outer least(..,
-- available) guards against numeric division rounding a quotient up.
CREATE OR REPLACE FUNCTION tokenlease_grantable(
    available numeric, min_take numeric, want numeric, step numeric
) RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN (
    SELECT CASE WHEN c.candidate >= min_take AND c.candidate > 0 THEN c.candidate ELSE 0 END
    FROM (SELECT least(want, available, step * floor(available / step)) AS candidate) AS c
);
