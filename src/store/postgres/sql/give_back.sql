-- language=SQL
-- Return unused lease tokens, idempotently, for one or many keys.
--
-- $1 int8[]  return ids (distinct; a retry reuses its id)
-- $2 text[]  keys (distinct)
-- $3 text[]  amounts
-- $4 text[]  capacities
-- $5 text[]  refill rates
--
-- `fresh` records each id once; only ids recorded by this statement credit their bucket, so a
-- retried return (whose first attempt may have committed unseen) credits nothing. The credit
-- refills first, then adds, capped at capacity. A bucket with no row is full and stays full
-- (the insert branch writes a full bucket). Rows are written in key order, like acquire.sql.
WITH ret AS (
    SELECT *
    FROM unnest($1::int8[], $2::text[], $3::text[]::numeric[], $4::text[]::numeric[],
                $5::text[]::numeric[])
        AS r(id, key, amount, capacity, rate)
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
    (tokens, capacity, refill_per_second, updated_at, last_granted) = (
        SELECT least(credit.capacity,
                     tokenlease_refill(b.tokens, credit.capacity, credit.rate, b.updated_at,
                                       now()) + credit.amount),
               credit.capacity, credit.rate, greatest(b.updated_at, now()), 0
        FROM credit
        WHERE credit.key = b.key
    )
RETURNING b.key
