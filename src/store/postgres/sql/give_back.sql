-- tokenlease: return of unused lease tokens (src/store/postgres/lean.rs)
WITH fresh AS (
    INSERT INTO tokenlease_returns AS t (id, key, amount)
    SELECT f.id, f.key, f.amount
    FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, key, amount)
    ORDER BY f.id
    ON CONFLICT (id) DO NOTHING
    RETURNING t.id),
upserted AS (
    INSERT INTO tokenlease_buckets AS b
        (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
    SELECT q.key, q.capacity, 0, q.capacity, q.rate,
           (SELECT (extract(epoch FROM now()) * 1000000)::bigint), q.capacity
    FROM unnest($1::bigint[], $2::text[], $4::bigint[], $5::bigint[])
        AS q(id, key, capacity, rate)
    WHERE q.id IN (SELECT fresh.id FROM fresh)
    ORDER BY q.key
    ON CONFLICT (key) DO UPDATE
    SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) = (
        SELECT
            CASE WHEN cardinality(b.leases) = 0
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
            CASE WHEN cardinality(b.leases) = 0
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
            r.capacity, r.rate, greatest(b.updated_us, r.now_us), 0,
            CASE WHEN cardinality(b.leases) = 0 THEN b.leases
                 ELSE CASE WHEN r.holder IS NULL THEN tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0)
                           ELSE tokenlease_release(b.leases, now(), r.holder, r.lease_id) END
            END
        FROM (SELECT ($3::bigint[])[p.n] AS amount, excluded.capacity AS capacity,
                     excluded.refill_per_second AS rate, excluded.updated_us AS now_us,
                     ($6::bigint[])[p.n] AS holder, ($7::bigint[])[p.n] AS lease_id
              FROM (SELECT array_position($2::text[], excluded.key) AS n OFFSET 0) AS p
              OFFSET 0) AS r)
    RETURNING b.key, b.refilled)
SELECT upserted.key FROM upserted WHERE upserted.refilled = 0
