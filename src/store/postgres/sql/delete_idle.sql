-- language=SQL
-- Delete up to $1 buckets that have refilled to full. An absent row is a full bucket, so this
-- changes no decision. A bucket with a strict lease still live cannot be full (the refill stops
-- at capacity less the leased tokens), so no live lease is forgotten. SKIP LOCKED leaves rows
-- that a take is updating right now to a later round; FOR UPDATE re-checks the condition on the
-- newest row version before deleting.
--
-- A row without strict leases is full when its femtotokens plus the refill since updated_us
-- reach the capacity: tokens * 10^6 + frac + elapsed_us * rate >= capacity * 10^6, in numeric
-- (exact, and this runs in the background, not per decision). A row with strict leases goes
-- through migration 0003's tokenlease_refill_held, in tokens.
WITH idle AS (
    SELECT key
    FROM {buckets}
    WHERE CASE WHEN cardinality(leases) = 0
               THEN tokens >= capacity
                    OR tokens * 1000000.0 + frac
                       + greatest(0, (extract(epoch FROM now()) * 1000000)::bigint - updated_us)
                         * refill_per_second::numeric
                       >= capacity * 1000000.0
               ELSE tokenlease_refill_held(tokenlease_amount(tokens, frac),
                                           capacity / 1000000000.0,
                                           refill_per_second / 1000000000.0,
                                           timestamptz 'epoch' + updated_us * interval '1 microsecond',
                                           leases, now()) * 1000000000 >= capacity
          END
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
-- Lease returns older than a day can no longer be retried: forget their ids.
old_returns AS (
    DELETE FROM {returns}
    WHERE id IN (SELECT id FROM {returns}
                 WHERE returned_at < now() - interval '1 day'
                 LIMIT $1 FOR UPDATE SKIP LOCKED)
)
DELETE FROM {buckets} AS b
USING idle
WHERE b.key = idle.key
RETURNING b.key
