-- A candidate one-key take measured for docs/results.md ("The one statement's cost on the
-- server"); not what the store sends. UPDATE only (a key without a row would need the upsert
-- after it), for exact takes (min = want), on a row whose stored capacity and rate are the
-- call's. The arithmetic is bigint: the elapsed microseconds are capped at the time the
-- call's bucket takes to fill from empty (2,000,000 us for scripts/statement-instructions.sh's
-- 100 tokens at 50 tokens/s; a store would send it as a parameter), beyond which the bucket is
-- full anyway, so no product leaves bigint for capacities up to about 9,000 tokens.
-- The refill computed once in a FROM item that locks the row (FOR UPDATE), the grant
-- returned from it, refilled not written.
UPDATE tokenlease_buckets AS b
SET tokens = x.a - x.g, frac = x.f, updated_us = greatest(b.updated_us, x.now_us)
FROM (SELECT y.a, y.f, y.now_us, CASE WHEN y.a >= $5 THEN $5 ELSE 0 END AS g
      FROM (SELECT z.tokens + z.femto / 1000000 AS a, (z.femto % 1000000)::integer AS f, z.now_us
            FROM (SELECT l.tokens, n.now_us,
                         least((l.capacity - l.tokens) * 1000000,
                               greatest(0, least(n.now_us - l.updated_us, 2000000))
                               * l.refill_per_second + l.frac) AS femto
                  FROM tokenlease_buckets AS l, (SELECT (extract(epoch FROM now()) * 1000000)::bigint AS now_us) AS n
                  WHERE l.key = $1 AND l.capacity = $2 AND l.refill_per_second = $3
                    AND cardinality(l.leases) = 0 AND l.tokens <= l.capacity
                  FOR UPDATE OF l) AS z OFFSET 0) AS y) AS x
WHERE b.key = $1
RETURNING b.key, b.tokens, b.frac, x.g, b.updated_us, x.now_us
