-- tokenlease: refill and take, one key (src/store/postgres/lean.rs)
INSERT INTO tokenlease_buckets AS b
    (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
VALUES ($1, $2 - (CASE WHEN $2 >= $4 AND $5 >= $4 THEN least($5, ($2) / $6 * $6) ELSE 0 END),
        0, $2, $3, (extract(epoch FROM now()) * 1000000)::bigint, $2)
ON CONFLICT (key) DO UPDATE
SET (tokens, frac, refilled) = (
        SELECT refill.available - (CASE WHEN refill.available >= $4 AND $5 >= $4
                                        THEN least($5, (refill.available) / $6 * $6)
                                        ELSE 0 END),
               refill.frac, refill.available
        FROM (SELECT (b.tokens + div(f.femto, 1000000)::bigint) AS available,
                     mod(f.femto, 1000000)::integer AS frac
              FROM (SELECT least((excluded.capacity - b.tokens)::numeric * 1000000,
                                 (greatest(0, excluded.updated_us - b.updated_us)::numeric
                                  * excluded.refill_per_second + b.frac)) AS femto
                    OFFSET 0) AS f
              OFFSET 0) AS refill),
    capacity = excluded.capacity, refill_per_second = excluded.refill_per_second,
    updated_us = greatest(b.updated_us, excluded.updated_us)
WHERE cardinality(b.leases) = 0
RETURNING b.key, b.tokens, b.frac, b.refilled - b.tokens, b.updated_us,
          (extract(epoch FROM now()) * 1000000)::bigint
