-- language=SQL
-- One bucket as stored, as refilled to now(), and its strict leases still live (JSON, amounts
-- as decimal text, expiry as microseconds since the Unix epoch).
SELECT key, tokens::text, capacity::text, refill_per_second::text, updated_at, now(),
       tokenlease_refill_held(tokens, capacity, refill_per_second, updated_at, leases, now())
           ::numeric(38, 18)::text,
       (SELECT coalesce(json_agg(json_build_object(
                   'holder', l.holder, 'lease_id', l.lease_id, 'amount', l.amount::text,
                   'expires_us', (extract(epoch FROM l.expires_at) * 1000000)::int8)
                   ORDER BY l.holder), '[]')::text
        FROM unnest(leases) AS l
        WHERE l.expires_at > now())
FROM tokenlease_buckets
WHERE key = $1
