-- tokenlease: refill and take, many keys (src/store/postgres/lean.rs)
INSERT INTO {buckets} AS b
    (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
SELECT r.key,
       r.capacity - (CASE WHEN r.capacity >= r.min_take AND r.want >= r.min_take
                          THEN least(r.want, (r.capacity) / r.step * r.step) ELSE 0 END),
       0, r.capacity, r.rate, (SELECT (extract(epoch FROM now()) * 1000000)::bigint),
       r.capacity
FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[])
    AS r(key, capacity, rate, min_take, want, step)
ORDER BY r.key
ON CONFLICT (key) DO UPDATE
SET (tokens, frac, refilled) = (
        SELECT refill.available - (CASE WHEN refill.available >= refill.min_take
                                             AND refill.want >= refill.min_take
                                        THEN least(refill.want,
                                                   (refill.available) / refill.step * refill.step)
                                        ELSE 0 END),
               refill.frac, refill.available
        FROM (SELECT (b.tokens + div(f.femto, 1000000)::bigint) AS available,
                     mod(f.femto, 1000000)::integer AS frac,
                     ($4::bigint[])[f.n] AS min_take, ($5::bigint[])[f.n] AS want,
                     ($6::bigint[])[f.n] AS step
              FROM (SELECT least((excluded.capacity - b.tokens)::numeric * 1000000,
                                 (greatest(0, excluded.updated_us - b.updated_us)::numeric
                                  * excluded.refill_per_second + b.frac)) AS femto,
                           array_position($1::text[], excluded.key) AS n
                    OFFSET 0) AS f
              OFFSET 0) AS refill),
    capacity = excluded.capacity, refill_per_second = excluded.refill_per_second,
    updated_us = greatest(b.updated_us, excluded.updated_us)
WHERE cardinality(b.leases) = 0
RETURNING b.key, b.tokens, b.frac, b.refilled - b.tokens, b.updated_us,
          (SELECT (extract(epoch FROM now()) * 1000000)::bigint)
