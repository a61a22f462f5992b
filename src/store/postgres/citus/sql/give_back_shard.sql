WITH r AS MATERIALIZED (
    SELECT q.id, q.key, q.amount, q.capacity, q.rate, q.holder, q.lease_id,
           (extract(epoch FROM now()) * 1000000)::bigint AS now_us
    FROM unnest($8::integer[]) AS m(n)
    JOIN unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[],
                $6::bigint[], $7::bigint[]) WITH ORDINALITY
        AS q(id, key, amount, capacity, rate, holder, lease_id, n) ON q.n = m.n),
fresh AS (
    INSERT INTO {returns} AS t (id, key, amount)
    SELECT r.id, r.key, r.amount FROM r
    ORDER BY r.key, r.id
    ON CONFLICT (key, id) DO NOTHING
    RETURNING t.key, t.id),
todo AS MATERIALIZED (
    SELECT r.* FROM r JOIN fresh ON fresh.key = r.key AND fresh.id = r.id),
locked AS (
    SELECT l.key FROM {buckets} AS l
    WHERE l.key IN (SELECT todo.key FROM todo)
    ORDER BY l.key FOR UPDATE)
UPDATE {buckets} AS b
SET tokens = CASE WHEN cardinality(b.leases) = 0
                  THEN ((b.tokens + div(least((r.capacity - b.tokens)::numeric * 1000000,
                                              (greatest(0, r.now_us - b.updated_us)::numeric
                                               * r.rate + b.frac)), 1000000)::bigint))
                       + least(r.amount,
                               r.capacity
                               - ((b.tokens + div(least((r.capacity - b.tokens)::numeric * 1000000,
                                                        (greatest(0, r.now_us - b.updated_us)::numeric
                                                         * r.rate + b.frac)), 1000000)::bigint)))
                  ELSE floor(least(greatest(0, r.capacity / 1000000000.0
                                               - tokenlease_outstanding(CASE WHEN r.holder IS NULL
                                                                             THEN tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0)
                                                                             ELSE tokenlease_release(b.leases, now(), r.holder, r.lease_id)
                                                                        END, now())),
                                   tokenlease_refill_held(tokenlease_amount(b.tokens, b.frac),
                                                          r.capacity / 1000000000.0, r.rate / 1000000000.0,
                                                          timestamptz 'epoch' + b.updated_us * interval '1 microsecond',
                                                          b.leases, now())
                                   + CASE WHEN r.holder IS NULL THEN r.amount / 1000000000.0
                                          ELSE tokenlease_release_credit(b.leases, now(), r.holder, r.lease_id,
                                                                         r.amount / 1000000000.0) END)
                             * 1000000000)::bigint
             END,
    frac = CASE WHEN cardinality(b.leases) = 0
                THEN CASE WHEN r.amount >= r.capacity
                                           - ((b.tokens + div(least((r.capacity - b.tokens)::numeric * 1000000,
                                                                    (greatest(0, r.now_us - b.updated_us)::numeric
                                                                     * r.rate + b.frac)), 1000000)::bigint))
                          THEN 0
                          ELSE mod(least((r.capacity - b.tokens)::numeric * 1000000,
                                         (greatest(0, r.now_us - b.updated_us)::numeric * r.rate + b.frac)),
                                   1000000)::integer END
                ELSE (floor(least(greatest(0, r.capacity / 1000000000.0
                                              - tokenlease_outstanding(CASE WHEN r.holder IS NULL
                                                                            THEN tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0)
                                                                            ELSE tokenlease_release(b.leases, now(), r.holder, r.lease_id)
                                                                       END, now())),
                                  tokenlease_refill_held(tokenlease_amount(b.tokens, b.frac),
                                                         r.capacity / 1000000000.0, r.rate / 1000000000.0,
                                                         timestamptz 'epoch' + b.updated_us * interval '1 microsecond',
                                                         b.leases, now())
                                  + CASE WHEN r.holder IS NULL THEN r.amount / 1000000000.0
                                         ELSE tokenlease_release_credit(b.leases, now(), r.holder, r.lease_id,
                                                                        r.amount / 1000000000.0) END)
                            * 1000000000000000) % 1000000)::integer
           END,
    capacity = r.capacity,
    refill_per_second = r.rate,
    updated_us = greatest(b.updated_us, r.now_us),
    refilled = 0,
    leases = CASE WHEN cardinality(b.leases) = 0 THEN b.leases
                  ELSE CASE WHEN r.holder IS NULL THEN tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0)
                            ELSE tokenlease_release(b.leases, now(), r.holder, r.lease_id) END
             END
FROM todo AS r
WHERE b.key = r.key AND (SELECT count(*) FROM locked) >= 0
RETURNING b.key
