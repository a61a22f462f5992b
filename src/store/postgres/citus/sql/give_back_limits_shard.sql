-- tokenlease: return of unused lease tokens, several limits (src/store/postgres/limits.rs)
WITH fresh AS (
    INSERT INTO {returns} AS t (id, key, amount)
    SELECT f.id, f.key, f.amount
    FROM unnest($1::bigint[], $2::text[], $3::bigint[]) WITH ORDINALITY AS f(id, key, amount, n)
    JOIN unnest($10::integer[]) AS fm(n) ON fm.n = f.n
    ORDER BY f.key, f.id
    ON CONFLICT (key, id) DO NOTHING
    RETURNING t.key, t.id),
upserted AS (
    INSERT INTO {buckets} AS b
        (key, tokens, frac, capacity, refill_per_second, updated_us, refilled,
         more_tokens, more_frac, more_capacity, more_rate)
    SELECT u.key, u.capacity, 0, u.capacity, u.rate,
           (SELECT (extract(epoch FROM now()) * 1000000)::bigint), u.capacity,
           ($6::bigint[])[u.first : u.first + u.count - 1], array_fill(0, ARRAY[u.count]),
           ($6::bigint[])[u.first : u.first + u.count - 1],
           ($7::bigint[])[u.first : u.first + u.count - 1]
    FROM unnest($1::bigint[], $2::text[], $4::bigint[], $5::bigint[], $8::integer[],
                $9::integer[]) WITH ORDINALITY
        AS u(id, key, capacity, rate, first, count, n)
    JOIN unnest($10::integer[]) AS um(n) ON um.n = u.n
    JOIN fresh ON fresh.key = u.key AND fresh.id = u.id  ORDER BY u.key
    ON CONFLICT (key) DO UPDATE
    SET (tokens, frac, refilled, more_tokens, more_frac) = (
            SELECT a.avail0 + least(r.amount, excluded.capacity - a.avail0),
                   CASE WHEN r.amount >= excluded.capacity - a.avail0 THEN 0 ELSE a.frac0 END,
                   0,
                   (SELECT array_agg(mr.avail + least(r.amount, mr.cap - mr.avail) ORDER BY mr.i)
                    FROM (SELECT x.i, x.cap, x.tok + div(x.femto, 1000000)::bigint AS avail,
                                 mod(x.femto, 1000000)::integer AS frac
                          FROM (SELECT s.i, (excluded.more_capacity)[s.i] AS cap,
                                       coalesce(b.more_tokens[s.i], (excluded.more_capacity)[s.i]) AS tok,
                                       least(((excluded.more_capacity)[s.i]
                                              - coalesce(b.more_tokens[s.i], (excluded.more_capacity)[s.i]))::numeric
                                             * 1000000,
                                             greatest(0, r.now_us - b.updated_us)::numeric
                                             * (excluded.more_rate)[s.i] + coalesce(b.more_frac[s.i], 0)) AS femto
                                FROM generate_subscripts(excluded.more_capacity, 1) AS s(i)
                                OFFSET 0) AS x) AS mr),
                   (SELECT array_agg(CASE WHEN r.amount >= mr.cap - mr.avail THEN 0 ELSE mr.frac END
                                     ORDER BY mr.i)
                    FROM (SELECT x.i, x.cap, x.tok + div(x.femto, 1000000)::bigint AS avail,
                                 mod(x.femto, 1000000)::integer AS frac
                          FROM (SELECT s.i, (excluded.more_capacity)[s.i] AS cap,
                                       coalesce(b.more_tokens[s.i], (excluded.more_capacity)[s.i]) AS tok,
                                       least(((excluded.more_capacity)[s.i]
                                              - coalesce(b.more_tokens[s.i], (excluded.more_capacity)[s.i]))::numeric
                                             * 1000000,
                                             greatest(0, r.now_us - b.updated_us)::numeric
                                             * (excluded.more_rate)[s.i] + coalesce(b.more_frac[s.i], 0)) AS femto
                                FROM generate_subscripts(excluded.more_capacity, 1) AS s(i)
                                OFFSET 0) AS x) AS mr)
            FROM (SELECT ($3::bigint[])[p.n] AS amount, excluded.updated_us AS now_us
                  FROM (SELECT array_position($2::text[], excluded.key) AS n OFFSET 0) AS p
                  OFFSET 0) AS r,
                 LATERAL (SELECT (b.tokens + div(least((excluded.capacity - b.tokens)::numeric * 1000000,
                                                       (greatest(0, r.now_us - b.updated_us)::numeric
                                                        * excluded.refill_per_second + b.frac)),
                                                 1000000)::bigint) AS avail0,
                                 mod(least((excluded.capacity - b.tokens)::numeric * 1000000,
                                           (greatest(0, r.now_us - b.updated_us)::numeric
                                            * excluded.refill_per_second + b.frac)),
                                     1000000)::integer AS frac0
                          OFFSET 0) AS a),
        capacity = excluded.capacity, refill_per_second = excluded.refill_per_second,
        more_capacity = excluded.more_capacity, more_rate = excluded.more_rate,
        updated_us = greatest(b.updated_us, excluded.updated_us)
    WHERE cardinality(b.leases) = 0
    RETURNING b.key, b.refilled)
SELECT upserted.key FROM upserted WHERE upserted.refilled = 0
