-- language=SQL
-- Return unused lease tokens, idempotently, for one or many keys.
--
-- $1 int8[]  return ids (distinct; a retry reuses its id)
-- $2 text[]  keys (distinct)
-- $3 text[]  amounts
-- $4 text[]  capacities
-- $5 text[]  refill rates
-- $6 int8[]  holder of the strict lease being settled, or NULL (a relaxed lease)
-- $7 int8[]  that lease's id (strict only)
--
-- `fresh` records each id once; only ids recorded by this statement credit their bucket, so a
-- retried return (whose first attempt may have committed unseen) credits nothing. The credit
-- refills first, then adds, capped at capacity less the tokens still out on strict leases. A
-- strict return settles its lease: the entry leaves the row, and the credit is at most what the
-- entry held, and nothing once the entry is gone (settled, replaced by a later grant, or
-- expired, when its tokens already came back through the refill). A bucket with no row is full
-- and stays full (the insert branch writes a full bucket). Rows are written in key order.
WITH ret AS (
    SELECT *
    FROM unnest($1::int8[], $2::text[], $3::text[]::numeric[], $4::text[]::numeric[],
                $5::text[]::numeric[], $6::int8[], $7::int8[])
        AS r(id, key, amount, capacity, rate, holder, lease_id)
),
fresh AS (
    INSERT INTO tokenlease_returns (id, key, amount)
    SELECT id, key, amount FROM ret ORDER BY id
    ON CONFLICT (id) DO NOTHING
    RETURNING id
),
credit AS (
    SELECT ret.* FROM ret JOIN fresh USING (id)
)
INSERT INTO tokenlease_buckets AS b
    (key, tokens, capacity, refill_per_second, updated_at, last_granted)
SELECT credit.key, credit.capacity, credit.capacity, credit.rate, now(), 0
FROM credit
ORDER BY credit.key
ON CONFLICT (key) DO UPDATE SET
    (tokens, capacity, refill_per_second, updated_at, last_granted, leases) = (
        SELECT least(CASE WHEN cardinality(s.leases) = 0 THEN credit.capacity
                          ELSE greatest(0, credit.capacity
                                           - tokenlease_outstanding(s.leases, now()))
                     END,
                     f.refilled + s.credited),
               credit.capacity, credit.rate, greatest(b.updated_at, now()), 0, s.leases
        FROM credit
        CROSS JOIN LATERAL (
            SELECT CASE WHEN cardinality(b.leases) = 0
                        THEN tokenlease_refill(b.tokens, credit.capacity, credit.rate,
                                               b.updated_at, now())
                        ELSE tokenlease_refill_held(b.tokens, credit.capacity, credit.rate,
                                                    b.updated_at, b.leases, now())
                   END AS refilled
        ) AS f
        CROSS JOIN LATERAL (
            SELECT CASE WHEN credit.holder IS NULL THEN credit.amount
                        WHEN cardinality(b.leases) = 0 THEN 0
                        ELSE tokenlease_release_credit(b.leases, now(), credit.holder,
                                                       credit.lease_id, credit.amount)
                   END AS credited,
                   CASE WHEN cardinality(b.leases) = 0 THEN b.leases
                        WHEN credit.holder IS NULL
                            THEN tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0)
                        ELSE tokenlease_release(b.leases, now(), credit.holder,
                                                credit.lease_id)
                   END AS leases
        ) AS s
        WHERE credit.key = b.key
    )
RETURNING b.key
