-- language=SQL
-- Refill and take, for one or many keys, in one atomic statement, with strict leases.
--
-- acquire.sql does the same for requests without a holder; this statement serves any batch in
-- which at least one request holds a strict lease (the others pass NULL holders).
--
-- $1  text[]  keys (distinct)
-- $2  text[]  capacities   (decimal text)
-- $3  text[]  refill rates (tokens per second, decimal text)
-- $4  text[]  min:  take nothing unless this many tokens can be granted
-- $5  text[]  want: take up to this many
-- $6  text[]  step: grant a multiple of this (the cost, for coalesced takes of one cost)
-- $7  int8[]  holder of a strict lease, or NULL (a plain take or a relaxed lease)
-- $8  int8[]  the new lease's id (strict only)
-- $9  text[]  tokens the holder keeps from its previous lease, which the new one carries on
-- $10 int8[]  how long the database counts the new lease, in microseconds
--
-- A new key is inserted as a full bucket less its grant. An existing key is refilled by the
-- database's now() (never rewinding updated_at, never above capacity less the tokens out on
-- strict leases), then granted what tokenlease_grantable allows. A strict request also settles
-- the holder's previous lease in the same step: what the holder spent of it is gone, what it
-- keeps carries into the new entry (kept + granted), so a renewal is one round trip. Should a
-- holder claim to keep more than its live entry holds, the difference is taken from the bucket.
-- A request without a holder on a row without lease entries takes the short path, skipping the
-- lease functions. The row lock taken by ON CONFLICT DO UPDATE makes all of this atomic; rows are inserted in
-- key order so concurrent multi-key statements lock in the same order and cannot deadlock.
-- last_granted carries the grant out through RETURNING, which sees only the new row.
WITH req AS (
    SELECT *
    FROM unnest($1::text[], $2::text[]::numeric[], $3::text[]::numeric[],
                $4::text[]::numeric[], $5::text[]::numeric[], $6::text[]::numeric[],
                $7::int8[], $8::int8[], $9::text[]::numeric[], $10::int8[])
        AS r(key, capacity, rate, min_take, want, step, holder, lease_id, kept, lifetime_us)
)
INSERT INTO tokenlease_buckets AS b
    (key, tokens, capacity, refill_per_second, updated_at, last_granted, leases)
SELECT req.key, a.available - g.granted, req.capacity, req.rate, now(), g.granted,
       CASE WHEN req.holder IS NULL THEN '{}'
            ELSE tokenlease_hold('{}', now(), req.holder, req.lease_id, req.kept + g.granted,
                                 req.lifetime_us)
       END
FROM req
CROSS JOIN LATERAL (
    SELECT CASE WHEN req.holder IS NULL THEN req.capacity
                ELSE greatest(0, req.capacity - req.kept)
           END AS available
) AS a
CROSS JOIN LATERAL (
    SELECT tokenlease_grantable(a.available, req.min_take, req.want, req.step) AS granted
) AS g
ORDER BY req.key
ON CONFLICT (key) DO UPDATE SET
    (tokens, capacity, refill_per_second, updated_at, last_granted, leases) = (
        SELECT a.available - g.granted, req.capacity, req.rate,
               greatest(b.updated_at, now()), g.granted,
               CASE WHEN s.plain THEN b.leases
                    ELSE tokenlease_hold(b.leases, now(), req.holder, req.lease_id,
                                         req.kept + g.granted, req.lifetime_us)
               END
        FROM req
        CROSS JOIN LATERAL (
            SELECT req.holder IS NULL AND cardinality(b.leases) = 0 AS plain
        ) AS s
        CROSS JOIN LATERAL (
            SELECT CASE WHEN s.plain
                        THEN tokenlease_refill(b.tokens, req.capacity, req.rate, b.updated_at,
                                               now())
                        ELSE tokenlease_available_held(b.tokens, req.capacity, req.rate,
                                                       b.updated_at, b.leases, now(),
                                                       req.holder, req.kept)
                   END AS available
        ) AS a
        CROSS JOIN LATERAL (
            SELECT tokenlease_grantable(a.available, req.min_take, req.want, req.step)
                       AS granted
        ) AS g
        WHERE req.key = b.key
    )
RETURNING b.key, b.tokens::text, b.last_granted::text, b.updated_at, now()
