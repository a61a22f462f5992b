-- Strict leases, and any take on a row that holds strict leases, as a PL/pgSQL function: the
-- leases are an array of entries whose arithmetic is in tokens (numeric), and such takes are
-- rare (a strict lease is renewed about once per lease lifetime). Plain takes never come here
-- (the store's UPDATE and INSERT statements, DESIGN.md section 5), unless their row holds
-- strict leases or the row appeared between the two.
--
-- As migration 0004's tokenlease_acquire, in two steps: (1) every key's row in key order, new
-- keys inserted full, existing ones locked; (2) refill and take joined by key. The refill and
-- the grant are migration 0003's numeric functions on the exact numeric value of the row
-- (tokenlease_amount); the result goes back to whole nanotokens and femtotokens exactly, since
-- every amount has at most 15 decimals (microseconds times nanotokens per second).
CREATE OR REPLACE FUNCTION tokenlease_acquire_held(
    keys        text[],
    capacities  bigint[],
    rates       bigint[],
    mins        bigint[],
    wants       bigint[],
    steps       bigint[],
    holders     bigint[] DEFAULT NULL,
    lease_ids   bigint[] DEFAULT NULL,
    kept        bigint[] DEFAULT NULL,
    lifetimes   bigint[] DEFAULT NULL
) RETURNS TABLE (
    key          text,
    tokens       bigint,
    frac         integer,
    granted      bigint,
    updated_us   bigint,
    now_us       bigint
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    at_us bigint := (extract(epoch FROM now()) * 1000000)::bigint;
BEGIN
    -- 1. Every key's row, in key order: new keys inserted full, existing ones locked.
    INSERT INTO tokenlease_buckets AS b
        (key, tokens, frac, capacity, refill_per_second, updated_us, refilled)
    SELECT r.key, r.capacity, 0, r.capacity, r.rate, at_us, r.capacity
    FROM unnest(keys, capacities, rates) AS r(key, capacity, rate)
    ORDER BY r.key
    ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false;

    -- 2. Refill and take, joined by key, in tokens.
    RETURN QUERY
    UPDATE tokenlease_buckets AS b
    SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) = (
            SELECT floor((a.available - g.granted) * 1000000000)::bigint,
                   (floor((a.available - g.granted) * 1000000000000000) % 1000000)::integer,
                   req.capacity, req.rate, greatest(b.updated_us, at_us),
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
    FROM unnest(keys, capacities, rates, mins, wants, steps, holders, lease_ids, kept,
                lifetimes)
        AS req(key, capacity, rate, min_take, want, step, holder, lease_id, kept, lifetime_us)
    WHERE b.key = req.key
      AND b.key = ANY (keys)
    RETURNING b.key, b.tokens::bigint, b.frac::integer, (b.refilled - b.tokens)::bigint,
              b.updated_us, at_us;
END
$$;

DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION tokenlease_acquire_held(text[], bigint[], bigint[], bigint[], bigint[], '
        'bigint[], bigint[], bigint[], bigint[], bigint[]) SET search_path = %I, pg_temp',
        (SELECT n.nspname
         FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.oid = 'tokenlease_buckets'::regclass));
END
$$;

COMMENT ON FUNCTION tokenlease_acquire_held(text[], bigint[], bigint[], bigint[], bigint[],
                                            bigint[], bigint[], bigint[], bigint[], bigint[]) IS
    'tokenlease refill and take with strict leases, for distinct keys, rows locked in key order: (key, nanotokens left, femtotokens, nanotokens granted, updated_us, now in microseconds)';
