UPDATE {buckets} AS b
SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) = (
        SELECT floor((a.available - g.granted) * 1000000000)::bigint,
               (floor((a.available - g.granted) * 1000000000000000) % 1000000)::integer,
               req.capacity, req.rate, greatest(b.updated_us, $11),
               floor(a.available * 1000000000)::bigint,
               CASE WHEN s.plain THEN b.leases
                    ELSE tokenlease_hold(b.leases, now(), req.holder, req.lease_id,
                                         req.kept / 1000000000.0 + g.granted,
                                         req.lifetime_us)
               END
        FROM (SELECT req.holder IS NULL AND cardinality(b.leases) = 0 AS plain,
                     tokenlease_amount(b.tokens, b.frac) AS tokens,
                     req.capacity / 1000000000.0 AS capacity,
                     req.rate / 1000000000.0 AS rate,
                     timestamptz 'epoch' + b.updated_us * interval '1 microsecond'
                         AS updated_at) AS s
        CROSS JOIN LATERAL (
            SELECT CASE WHEN s.plain
                        THEN tokenlease_refill(s.tokens, s.capacity, s.rate, s.updated_at,
                                               now())
                        WHEN req.holder IS NULL
                        THEN tokenlease_refill_held(s.tokens, s.capacity, s.rate,
                                                    s.updated_at, b.leases, now())
                        ELSE tokenlease_available_held(s.tokens, s.capacity, s.rate,
                                                       s.updated_at, b.leases, now(),
                                                       req.holder,
                                                       req.kept / 1000000000.0)
                   END AS available
        ) AS a
        CROSS JOIN LATERAL (
            SELECT tokenlease_grantable(a.available, req.min_take / 1000000000.0,
                                        req.want / 1000000000.0,
                                        req.step / 1000000000.0) AS granted
        ) AS g
    )
FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[],
            $7::bigint[], $8::bigint[], $9::bigint[], $10::bigint[]) WITH ORDINALITY
    AS req(key, capacity, rate, min_take, want, step, holder, lease_id, kept, lifetime_us, n)
WHERE b.key = req.key AND req.n = ANY ($12::integer[])
RETURNING b.key, b.tokens::bigint, b.frac::integer, (b.refilled - b.tokens)::bigint,
          b.updated_us, $11::bigint
