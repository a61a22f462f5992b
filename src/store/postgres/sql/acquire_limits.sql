-- tokenlease: refill and take, several limits (src/store/postgres/limits.rs)
INSERT INTO tokenlease_buckets AS b
    (key, tokens, frac, capacity, refill_per_second, updated_us, refilled,
     more_tokens, more_frac, more_capacity, more_rate)
SELECT r.key, r.capacity - n.g, 0, r.capacity, r.rate,
       (SELECT (extract(epoch FROM now()) * 1000000)::bigint), r.capacity,
       (SELECT array_agg(c.cap - n.g ORDER BY c.o)
        FROM unnest(r.caps) WITH ORDINALITY AS c(cap, o)),
       array_fill(0, ARRAY[r.count]), r.caps, r.rates
FROM (SELECT u.key, u.capacity, u.rate, u.min_take, u.want, u.step, u.count,
             ($7::bigint[])[u.first : u.first + u.count - 1] AS caps,
             ($8::bigint[])[u.first : u.first + u.count - 1] AS rates
      FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[],
                  $6::bigint[], $9::integer[], $10::integer[])
          AS u(key, capacity, rate, min_take, want, step, first, count)) AS r
CROSS JOIN LATERAL (SELECT CASE WHEN least(r.capacity, lm.least_more) >= r.min_take
                                 AND r.want >= r.min_take
                            THEN least(r.want, (least(r.capacity, lm.least_more)) / r.step * r.step)
                            ELSE 0 END AS g
                    FROM (SELECT (SELECT min(c) FROM unnest(r.caps) AS c) AS least_more OFFSET 0) AS lm) AS n
ORDER BY r.key
ON CONFLICT (key) DO UPDATE
SET (tokens, frac, refilled, more_tokens, more_frac) = (
        SELECT t.avail0 - t.g, t.frac0, t.avail0,
               (SELECT array_agg(m.avail - t.g ORDER BY m.o)
                FROM unnest(t.mavail) WITH ORDINALITY AS m(avail, o)),
               t.mfrac
        FROM (SELECT e.avail0, e.frac0, e.mavail, e.mfrac,
                     CASE WHEN least(e.avail0, e.least_more) >= q.min_take AND q.want >= q.min_take
                          THEN least(q.want, (least(e.avail0, e.least_more)) / q.step * q.step)
                          ELSE 0 END AS g
              FROM (SELECT ($4::bigint[])[p.n] AS min_take, ($5::bigint[])[p.n] AS want,
                           ($6::bigint[])[p.n] AS step
                    FROM (SELECT array_position($1::text[], excluded.key) AS n OFFSET 0) AS p
                    OFFSET 0) AS q,
                   (SELECT f.avail0, f.frac0,
                           array_agg(mr.avail ORDER BY mr.i) AS mavail,
                           array_agg(mr.frac ORDER BY mr.i) AS mfrac,
                           min(mr.avail) AS least_more
                    FROM (SELECT (b.tokens + div(least((excluded.capacity - b.tokens)::numeric * 1000000,
                                                       (greatest(0, excluded.updated_us - b.updated_us)::numeric
                                                        * excluded.refill_per_second + b.frac)),
                                                 1000000)::bigint) AS avail0,
                                 mod(least((excluded.capacity - b.tokens)::numeric * 1000000,
                                           (greatest(0, excluded.updated_us - b.updated_us)::numeric
                                            * excluded.refill_per_second + b.frac)),
                                     1000000)::integer AS frac0
                          OFFSET 0) AS f
                    CROSS JOIN (SELECT x.i, x.cap, x.tok + div(x.femto, 1000000)::bigint AS avail,
                                       mod(x.femto, 1000000)::integer AS frac
                                FROM (SELECT s.i, (excluded.more_capacity)[s.i] AS cap,
                                             coalesce(b.more_tokens[s.i], (excluded.more_capacity)[s.i]) AS tok,
                                             least(((excluded.more_capacity)[s.i]
                                                    - coalesce(b.more_tokens[s.i], (excluded.more_capacity)[s.i]))::numeric
                                                   * 1000000,
                                                   greatest(0, excluded.updated_us - b.updated_us)::numeric
                                                   * (excluded.more_rate)[s.i] + coalesce(b.more_frac[s.i], 0)) AS femto
                                      FROM generate_subscripts(excluded.more_capacity, 1) AS s(i)
                                      OFFSET 0) AS x) AS mr
                    GROUP BY f.avail0, f.frac0) AS e
              OFFSET 0) AS t),
    capacity = excluded.capacity, refill_per_second = excluded.refill_per_second,
    more_capacity = excluded.more_capacity, more_rate = excluded.more_rate,
    updated_us = greatest(b.updated_us, excluded.updated_us)
WHERE cardinality(b.leases) = 0
RETURNING b.key, b.tokens::bigint, b.frac::integer, (b.refilled - b.tokens)::bigint,
          b.updated_us::bigint, (SELECT (extract(epoch FROM now()) * 1000000)::bigint),
          b.more_tokens::bigint[], b.more_frac::integer[]
