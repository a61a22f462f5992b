-- language=SQL
-- One bucket as stored, and as refilled to now().
SELECT key, tokens::text, capacity::text, refill_per_second::text, updated_at, now(),
       tokenlease_refill(tokens, capacity, refill_per_second, updated_at, now())::numeric(38, 18)::text
FROM tokenlease_buckets
WHERE key = $1
