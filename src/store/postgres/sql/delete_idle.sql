-- language=SQL
-- Delete up to $1 buckets that have refilled to full. An absent row is a full bucket, so this
-- changes no decision. A bucket with a strict lease still live cannot be full (the refill stops
-- at capacity less the leased tokens), so no live lease is forgotten. SKIP LOCKED leaves rows
-- that a take is updating right now to a later round; FOR UPDATE re-checks the condition on the
-- newest row version before deleting.
WITH idle AS (
    SELECT key
    FROM tokenlease_buckets
    WHERE CASE WHEN cardinality(leases) = 0
               THEN tokenlease_refill(tokens, capacity, refill_per_second, updated_at, now())
               ELSE tokenlease_refill_held(tokens, capacity, refill_per_second, updated_at,
                                           leases, now())
          END >= capacity
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
-- Lease returns older than a day can no longer be retried: forget their ids.
old_returns AS (
    DELETE FROM tokenlease_returns
    WHERE id IN (SELECT id FROM tokenlease_returns
                 WHERE returned_at < now() - interval '1 day'
                 LIMIT $1 FOR UPDATE SKIP LOCKED)
)
DELETE FROM tokenlease_buckets AS b
USING idle
WHERE b.key = idle.key
RETURNING b.key
