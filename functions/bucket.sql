-- The bucket's arithmetic in tokens (numeric): the refill, the grant, and the exact numeric
-- amount of a row's integer columns. The strict-lease path (held_leases.sql,
-- acquire_held.sql) counts in tokens; plain takes use the integer statements the store sends.

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

-- tokenlease_grantable as PL/pgSQL: the same arithmetic, without planning its body on every
-- statement.
--
-- The first migration wrote it as a LANGUAGE sql function whose body is a subquery, on the
-- assumption that the planner inlines it like tokenlease_refill. It cannot: a scalar SQL function
-- is inlined only when its body is a bare expression, and even then not when an argument that
-- the body uses more than once is an expensive expression, which `available` is once the
-- planner has flattened the UPDATE's lateral subqueries into one expression. Not inlined, a
-- LANGUAGE sql function is run by the SQL-function executor, which parses and plans its body
-- once per call site per statement: tokenlease_acquire's UPDATE calls it in two places (three
-- with strict leases), so every statement planned the body two or three times. Measured with
-- auto_explain on one key: the UPDATE's per-row SET subplan took 0.21 ms, against 0.016 ms
-- with this function, which PL/pgSQL keeps planned for the session like the other helpers of
-- migration 0003 (its one expression runs on PL/pgSQL's simple-expression path).
--
-- What it computes is unchanged, and the same as AcquireRequest::grantable in the library: the
-- largest multiple of `step` that is at most `want` and at most `available`, if that reaches
-- `min_take` (and is above zero); otherwise 0. The least(.., available, ..) guards against
-- numeric division rounding a quotient up.
CREATE OR REPLACE FUNCTION tokenlease_grantable(
    available numeric, min_take numeric, want numeric, step numeric
) RETURNS numeric
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    candidate numeric := least(want, available, step * floor(available / step));
BEGIN
    RETURN CASE WHEN candidate >= min_take AND candidate > 0 THEN candidate ELSE 0 END;
END
$$;

-- A row's tokens as a numeric amount of tokens, exact: for the strict-lease helpers of
-- migration 0003, which count in tokens.
CREATE OR REPLACE FUNCTION tokenlease_amount(nanotokens bigint, femtotokens integer)
RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN nanotokens / 1000000000.0 + femtotokens / 1000000000000000.0;
