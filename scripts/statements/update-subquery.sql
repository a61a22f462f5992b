-- A candidate one-key take measured for docs/results.md ("The one statement's cost on the
-- server"); not what the store sends. UPDATE only (a key without a row would need the upsert
-- after it), for exact takes (min = want), on a row whose stored capacity and rate are the
-- call's. The arithmetic is bigint: the elapsed microseconds are capped at the time the
-- call's bucket takes to fill from empty (2,000,000 us for scripts/statement-instructions.sh's
-- 100 tokens at 50 tokens/s; a store would send it as a parameter), beyond which the bucket is
-- full anyway, so no product leaves bigint for capacities up to about 9,000 tokens.
-- The shipped take's two subquery levels in the SET, in bigint.
UPDATE tokenlease_buckets AS b
SET (tokens, frac, refilled) = (
    SELECT r.a - CASE WHEN r.a >= $5 THEN $5 ELSE 0 END, r.f, r.a
    FROM (SELECT b.tokens + x.femto / 1000000 AS a, (x.femto % 1000000)::integer AS f
          FROM (SELECT least((b.capacity - b.tokens) * 1000000, (greatest(0, least((extract(epoch FROM now()) * 1000000)::bigint - b.updated_us, 2000000)) * b.refill_per_second + b.frac)) AS femto OFFSET 0) AS x OFFSET 0) AS r),
    updated_us = greatest(b.updated_us, (extract(epoch FROM now()) * 1000000)::bigint)
WHERE b.key = $1 AND b.capacity = $2 AND b.refill_per_second = $3 AND cardinality(b.leases) = 0
  AND b.tokens <= b.capacity
RETURNING b.key, b.tokens, b.frac, b.refilled - b.tokens, b.updated_us, (extract(epoch FROM now()) * 1000000)::bigint
