-- update-grant-in-where.sql on the narrow table of narrow-table.sql: no domains, no strict
-- leases to test, four columns returned.
UPDATE narrow AS b
SET tokens = (b.tokens + least((b.capacity - b.tokens) * 1000000, greatest(0, least((extract(epoch FROM now()) * 1000000)::bigint - b.updated_us, 2000000)) * b.refill_per_second + b.frac) / 1000000) - $5,
    frac = (least((b.capacity - b.tokens) * 1000000, greatest(0, least((extract(epoch FROM now()) * 1000000)::bigint - b.updated_us, 2000000)) * b.refill_per_second + b.frac) % 1000000)::integer,
    updated_us = greatest(b.updated_us, (extract(epoch FROM now()) * 1000000)::bigint)
WHERE b.key = $1 AND b.capacity = $2 AND b.refill_per_second = $3 AND b.tokens <= b.capacity
  AND (b.tokens + least((b.capacity - b.tokens) * 1000000, greatest(0, least((extract(epoch FROM now()) * 1000000)::bigint - b.updated_us, 2000000)) * b.refill_per_second + b.frac) / 1000000) >= $5
RETURNING b.tokens, b.frac, b.updated_us, (extract(epoch FROM now()) * 1000000)::bigint
