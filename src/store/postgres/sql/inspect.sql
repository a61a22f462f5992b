-- language=SQL
-- One bucket as stored, as refilled to now(), and its strict leases still live (JSON, amounts
-- as decimal text, expiry as microseconds since the Unix epoch). Amounts are tokens as decimal
-- text (nanotokens and femtotokens joined exactly), times microseconds since the Unix epoch.
SELECT key, tokenlease_amount(tokens, frac)::numeric(38, 18)::text,
       (capacity / 1000000000.0)::numeric(38, 18)::text,
       (refill_per_second / 1000000000.0)::numeric(38, 18)::text, updated_us,
       (extract(epoch FROM now()) * 1000000)::bigint,
       tokenlease_refill_held(tokenlease_amount(tokens, frac), capacity / 1000000000.0,
                              refill_per_second / 1000000000.0,
                              timestamptz 'epoch' + updated_us * interval '1 microsecond',
                              leases, now())::numeric(38, 18)::text,
       (SELECT coalesce(json_agg(json_build_object(
                   'holder', l.holder, 'lease_id', l.lease_id, 'amount', l.amount::text,
                   'expires_us', (extract(epoch FROM l.expires_at) * 1000000)::int8)
                   ORDER BY l.holder), '[]')::text
        FROM unnest(leases) AS l
        WHERE l.expires_at > now())
FROM {buckets}
WHERE key = $1
