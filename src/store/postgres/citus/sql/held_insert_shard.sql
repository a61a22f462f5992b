INSERT INTO {buckets} AS b (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
SELECT r.key, r.capacity, 0, r.capacity, r.rate, $4, r.capacity
FROM unnest($1::text[], $2::bigint[], $3::bigint[]) WITH ORDINALITY AS r(key, capacity, rate, n)
WHERE r.n = ANY ($5::integer[])
ORDER BY r.key
ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false
