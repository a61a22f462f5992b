-- Buckets in 64-bit integers, for the least server work per decision.
--
-- Until now a bucket held numeric(38, 18) amounts, and every take was a call of the PL/pgSQL
-- function tokenlease_acquire. Per decision the server paid for the function call (with its three
-- SET clauses), two inner statements, numeric arithmetic, text casts and five CHECK constraints.
-- From this version the store sends plain statements over integer columns, prepared once per
-- session where the connection allows it (DESIGN.md section 5 has the statements and the
-- measurements). What a row holds:
--
--   tokens             bigint   whole nanotokens (10^-9 token) in the bucket at updated_us
--   frac               integer  the part of a nanotoken below that, in femtotokens (10^-15
--                               token), 0 to 999999: what a refill of whole microseconds at a
--                               rate of whole nanotokens per second leaves over. With it the
--                               refill loses nothing, exactly as the numeric columns did
--   capacity           bigint   nanotokens, 1 to 8 * 10^18 (8,000,000,000 tokens)
--   refill_per_second  bigint   nanotokens per second, 1 to 10^18 (10^9 tokens a second)
--   updated_us         bigint   the database's clock at the last refill, microseconds since the
--                               Unix epoch (was updated_at, timestamptz)
--   refilled           bigint   the bucket's whole nanotokens refilled at updated_us, before the
--                               last take (was last_granted): RETURNING sees only the new row,
--                               and refilled - tokens is the grant
--   leases             unchanged: strict leases, amounts in tokens (numeric)
--
-- The refill's product (elapsed microseconds times the rate) is computed in numeric and capped
-- at capacity - tokens before it becomes a bigint, so no sum leaves bigint.
--
-- The bounds are domains, checked on every value written, not a table CHECK constraint: for a
-- table CHECK the executor prepares the constraint's expression afresh each time a statement
-- runs, prepared or not, which measured about a fifth of a one-row update's server CPU (DESIGN.md
-- section 5); a domain's check is prepared once per session. What a domain cannot say, a row's
-- tokens at most its capacity, every statement keeps by its arithmetic (tokens are capped at
-- the capacity of the call, and a row holding more, after its plan's capacity was lowered,
-- refills as a full bucket).
--
-- Deploy path. This migration rewrites the table (ALTER TABLE ... TYPE) under an ACCESS
-- EXCLUSIVE lock: takes wait for it (up to the store's lock_timeout, 100 ms by default, then they
-- are decided by the fallback). Measured on this project's 2-core machine while it compiled:
-- 0.8 s for 100,000 rows (DESIGN.md section 5). Instances of an older version still running afterwards find that
-- the functions they call (tokenlease_acquire, tokenlease_give_back) no longer exist: their
-- calls fail at once, and they decide by their fallback policy until they are replaced; their
-- circuit breaker keeps them from retrying on every call. Conversions: amounts are rounded down
-- to the nanotoken (at most 10^-9 token per row is dropped, never added), a capacity or rate
-- beyond the new bounds is clamped to them, a rate below one nanotoken a second becomes one.

DROP FUNCTION IF EXISTS tokenlease_acquire(text[], numeric[], numeric[], numeric[], numeric[],
                                           numeric[], bigint[], bigint[], numeric[], bigint[]);
DROP FUNCTION IF EXISTS tokenlease_give_back(bigint[], text[], numeric[], numeric[], numeric[],
                                             bigint[], bigint[]);

CREATE DOMAIN tokenlease_nanotokens AS bigint
    CHECK (VALUE BETWEEN 0 AND 8000000000000000000);
CREATE DOMAIN tokenlease_capacity AS bigint
    CHECK (VALUE BETWEEN 1 AND 8000000000000000000);
CREATE DOMAIN tokenlease_rate AS bigint
    CHECK (VALUE BETWEEN 1 AND 1000000000000000000);
CREATE DOMAIN tokenlease_femtotokens AS integer
    CHECK (VALUE BETWEEN 0 AND 999999);

ALTER TABLE tokenlease_buckets
    DROP CONSTRAINT IF EXISTS tokenlease_buckets_capacity_range,
    DROP CONSTRAINT IF EXISTS tokenlease_buckets_rate_range,
    DROP CONSTRAINT IF EXISTS tokenlease_buckets_tokens_range,
    DROP CONSTRAINT IF EXISTS tokenlease_buckets_last_granted_range,
    DROP CONSTRAINT IF EXISTS tokenlease_buckets_updated_at_finite,
    ALTER COLUMN tokens TYPE tokenlease_nanotokens
        USING least(floor(tokens * 1000000000), floor(capacity * 1000000000),
                    8000000000000000000)::bigint,
    ALTER COLUMN capacity TYPE tokenlease_capacity
        USING greatest(1, least(floor(capacity * 1000000000), 8000000000000000000))::bigint,
    ALTER COLUMN refill_per_second TYPE tokenlease_rate
        USING greatest(1, least(floor(refill_per_second * 1000000000),
                                1000000000000000000))::bigint,
    ALTER COLUMN updated_at TYPE bigint
        USING (extract(epoch FROM updated_at) * 1000000)::bigint,
    ALTER COLUMN last_granted DROP DEFAULT,
    ALTER COLUMN last_granted TYPE tokenlease_nanotokens
        USING least(floor(tokens * 1000000000), floor(capacity * 1000000000),
                    8000000000000000000)::bigint,
    ALTER COLUMN last_granted SET DEFAULT 0,
    ADD COLUMN frac tokenlease_femtotokens NOT NULL DEFAULT 0;

ALTER TABLE tokenlease_buckets RENAME COLUMN updated_at TO updated_us;
ALTER TABLE tokenlease_buckets RENAME COLUMN last_granted TO refilled;

COMMENT ON TABLE tokenlease_buckets IS
    'tokenlease token buckets in nanotokens (10^-9 token) as of updated_us (database time, microseconds since the Unix epoch); an absent row is a full bucket';
COMMENT ON COLUMN tokenlease_buckets.tokens IS
    'whole nanotokens in the bucket at updated_us';
COMMENT ON COLUMN tokenlease_buckets.frac IS
    'femtotokens (10^-15 token) below one nanotoken, left over by the last refill: 0 to 999999';
COMMENT ON COLUMN tokenlease_buckets.capacity IS 'nanotokens';
COMMENT ON COLUMN tokenlease_buckets.refill_per_second IS 'nanotokens per second';
COMMENT ON COLUMN tokenlease_buckets.updated_us IS
    'the database clock at the last refill, microseconds since the Unix epoch; never moves back';
COMMENT ON COLUMN tokenlease_buckets.refilled IS
    'whole nanotokens refilled at updated_us before the most recent take: refilled - tokens is its grant';

ALTER TABLE tokenlease_returns
    DROP CONSTRAINT IF EXISTS tokenlease_returns_amount_range,
    ALTER COLUMN amount TYPE tokenlease_nanotokens
        USING least(floor(amount * 1000000000), 8000000000000000000)::bigint;
COMMENT ON COLUMN tokenlease_returns.amount IS 'nanotokens';

-- A row's tokens as a numeric amount of tokens, exact: for the strict-lease helpers of
-- migration 0003, which count in tokens.
CREATE OR REPLACE FUNCTION tokenlease_amount(nanotokens bigint, femtotokens integer)
RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN nanotokens / 1000000000.0 + femtotokens / 1000000000000000.0;

-- Strict leases, and any take on a row that holds strict leases, as a PL/pgSQL function: the
-- leases are an array of entries whose arithmetic is in tokens (numeric), and such takes are
-- rare (a strict lease is renewed about once per lease lifetime). Plain takes never come here
-- (the store's UPDATE and INSERT statements, DESIGN.md section 5), unless their row holds
-- strict leases or the row appeared between the two.
--
-- As migration 0004's tokenlease_acquire, in two steps: (1) every key's row in key order, new
-- keys inserted full, existing ones locked; (2) refill and take joined by key. The refill and
-- the grant are migration 0003's numeric functions on the exact numeric value of the row
-- (tokenlease_amount); the result goes back to whole nanotokens and femtotokens exactly, since
-- every amount has at most 15 decimals (microseconds times nanotokens per second).
CREATE OR REPLACE FUNCTION tokenlease_acquire_held(
    keys        text[],
    capacities  bigint[],
    rates       bigint[],
    mins        bigint[],
    wants       bigint[],
    steps       bigint[],
    holders     bigint[] DEFAULT NULL,
    lease_ids   bigint[] DEFAULT NULL,
    kept        bigint[] DEFAULT NULL,
    lifetimes   bigint[] DEFAULT NULL
) RETURNS TABLE (
    key          text,
    tokens       bigint,
    frac         integer,
    granted      bigint,
    updated_us   bigint,
    now_us       bigint
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    at_us bigint := (extract(epoch FROM now()) * 1000000)::bigint;
BEGIN
    -- 1. Every key's row, in key order: new keys inserted full, existing ones locked.
    INSERT INTO tokenlease_buckets AS b
        (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
    SELECT r.key, r.capacity, 0, r.capacity, r.rate, at_us, r.capacity
    FROM unnest(keys, capacities, rates) AS r(key, capacity, rate)
    ORDER BY r.key
    ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false;

    -- 2. Refill and take, joined by key, in tokens.
    RETURN QUERY
    UPDATE tokenlease_buckets AS b
    SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) = (
            SELECT floor((a.available - g.granted) * 1000000000)::bigint,
                   (floor((a.available - g.granted) * 1000000000000000) % 1000000)::integer,
                   req.capacity, req.rate, greatest(b.updated_us, at_us),
                   floor(a.available * 1000000000)::bigint,
                   CASE WHEN s.plain THEN b.leases
                        ELSE tokenlease_hold(b.leases, now(), req.holder, req.lease_id,
                                             req.kept / 1000000000.0 + g.granted,
                                             req.lifetime_us)
                   END
            FROM (SELECT req.holder IS NULL AND cardinality(b.leases) = 0 AS plain,
                         tokenlease_amount(b.tokens, b.frac) AS tokens,
                         req.capacity / 1000000000.0 AS capacity,
                         req.rate / 1000000000.0 AS rate,
                         timestamptz 'epoch' + b.updated_us * interval '1 microsecond'
                             AS updated_at) AS s
            CROSS JOIN LATERAL (
                SELECT CASE WHEN s.plain
                            THEN tokenlease_refill(s.tokens, s.capacity, s.rate, s.updated_at,
                                                   now())
                            WHEN req.holder IS NULL
                            THEN tokenlease_refill_held(s.tokens, s.capacity, s.rate,
                                                        s.updated_at, b.leases, now())
                            ELSE tokenlease_available_held(s.tokens, s.capacity, s.rate,
                                                           s.updated_at, b.leases, now(),
                                                           req.holder,
                                                           req.kept / 1000000000.0)
                       END AS available
            ) AS a
            CROSS JOIN LATERAL (
                SELECT tokenlease_grantable(a.available, req.min_take / 1000000000.0,
                                            req.want / 1000000000.0,
                                            req.step / 1000000000.0) AS granted
            ) AS g
        )
    FROM unnest(keys, capacities, rates, mins, wants, steps, holders, lease_ids, kept,
                lifetimes)
        AS req(key, capacity, rate, min_take, want, step, holder, lease_id, kept, lifetime_us)
    WHERE b.key = req.key
      AND b.key = ANY (keys)
    RETURNING b.key, b.tokens::bigint, b.frac::integer, (b.refilled - b.tokens)::bigint,
              b.updated_us, at_us;
END
$$;

DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION tokenlease_acquire_held(text[], bigint[], bigint[], bigint[], bigint[], '
        'bigint[], bigint[], bigint[], bigint[], bigint[]) SET search_path = %I, pg_temp',
        (SELECT n.nspname
         FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.oid = 'tokenlease_buckets'::regclass));
END
$$;

COMMENT ON FUNCTION tokenlease_acquire_held(text[], bigint[], bigint[], bigint[], bigint[],
                                            bigint[], bigint[], bigint[], bigint[], bigint[]) IS
    'tokenlease refill and take with strict leases, for distinct keys, rows locked in key order: (key, nanotokens left, femtotokens, nanotokens granted, updated_us, now in microseconds)';
