-- language=SQL
-- Refill and take, for one or many keys, in one atomic statement: the bare statement.
--
-- The store does not send this: it calls tokenlease_acquire (acquire.sql, migration 0004), whose
-- plans PostgreSQL keeps per session and whose update is linear in the keys. This is the single
-- statement it replaced, kept for benchmarks that compare the two (scripts/peer-compare.sh,
-- benches/direct.rs): its ON CONFLICT DO UPDATE finds each row's request with a subquery over
-- the whole request, quadratic in the keys, and sent unnamed it is parsed and planned every call.
--
-- $1 text[]  keys (distinct)
-- $2 text[]  capacities   (decimal text)
-- $3 text[]  refill rates (tokens per second, decimal text)
-- $4 text[]  min:  take nothing unless this many tokens can be granted
-- $5 text[]  want: take up to this many
-- $6 text[]  step: grant a multiple of this (the cost, for coalesced takes of one cost)
--
-- A new key is inserted as a full bucket less its grant. An existing key is refilled by the
-- database's now() (never rewinding updated_at), then granted what tokenlease_grantable allows.
-- A row with strict leases out (acquire_held.sql) refills only up to its capacity less the
-- leases; every other row takes the plain refill, without calling the lease functions. The
-- row lock taken by ON CONFLICT DO UPDATE makes refill-and-take atomic; rows are inserted in
-- key order so concurrent multi-key statements lock in the same order and cannot deadlock.
-- last_granted carries the grant out through RETURNING, which sees only the new row.
WITH req AS (
    SELECT *
    FROM unnest($1::text[], $2::text[]::numeric[], $3::text[]::numeric[],
                $4::text[]::numeric[], $5::text[]::numeric[], $6::text[]::numeric[])
        AS r(key, capacity, rate, min_take, want, step)
)
INSERT INTO tokenlease_buckets AS b
    (key, tokens, capacity, refill_per_second, updated_at, last_granted)
SELECT req.key, req.capacity - g.granted, req.capacity, req.rate, now(), g.granted
FROM req
CROSS JOIN LATERAL (
    SELECT tokenlease_grantable(req.capacity, req.min_take, req.want, req.step) AS granted
) AS g
ORDER BY req.key
ON CONFLICT (key) DO UPDATE SET
    (tokens, capacity, refill_per_second, updated_at, last_granted, leases) = (
        SELECT f.refilled - g.granted, req.capacity, req.rate,
               greatest(b.updated_at, now()), g.granted,
               CASE WHEN cardinality(b.leases) = 0 THEN b.leases
                    ELSE tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0)
               END
        FROM req
        CROSS JOIN LATERAL (
            SELECT CASE WHEN cardinality(b.leases) = 0
                        THEN tokenlease_refill(b.tokens, req.capacity, req.rate, b.updated_at,
                                               now())
                        ELSE tokenlease_refill_held(b.tokens, req.capacity, req.rate,
                                                    b.updated_at, b.leases, now())
                   END AS refilled
        ) AS f
        CROSS JOIN LATERAL (
            SELECT tokenlease_grantable(f.refilled, req.min_take, req.want, req.step) AS granted
        ) AS g
        WHERE req.key = b.key
    )
RETURNING b.key, b.tokens::text, b.last_granted::text, b.updated_at, now()
