-- Refill and take, and the return of lease tokens, as server-side functions: what the client
-- sends becomes a one-line call (tokenlease_acquire here; tokenlease_give_back, at the end, is
-- built the same way).
--
-- Why a function: the store sends every statement unnamed (query_typed), so that it works behind
-- PgBouncer in transaction pooling, which has no prepared statements. PostgreSQL then parses and
-- plans the statement on every call, and for the refill-and-take statement that was more than
-- half of its cost (DESIGN.md §5). A PL/pgSQL function keeps the plans of its statements for the
-- life of the session (SPI plans in the function's compiled form), so the client's
-- `SELECT ... FROM tokenlease_acquire($1, ...)` is cheap to parse and plan, and the statements
-- inside are planned once per session. A LANGUAGE sql function would not do: on PostgreSQL 15
-- its body is planned again on every call (and an INSERT is never inlined).
--
-- Why two statements inside, not the one upsert: an ON CONFLICT DO UPDATE sees the request's
-- values only through EXCLUDED (table columns) or a subquery over the request, and the subquery
-- scanned every request row for every conflicting row: quadratic in the keys of a statement.
-- Here
--   1. one INSERT ... ON CONFLICT visits the keys in key order: a new key is inserted as a full
--      bucket, an existing one is only locked (DO UPDATE ... WHERE false locks the row and writes
--      no new version). Every row of the call is then locked, taken in key order as before, so two
--      multi-key calls never wait on each other in a cycle;
--   2. one UPDATE joins the request to its (now locked) rows by key and does the refill and the
--      take. It runs with a new snapshot, taken after step 1 got every lock, so it sees the newest
--      version of each row, which nobody else can change before the commit. A key inserted by step
--      1 is a full bucket refilled at now() by nothing, so step 2 leaves it full less its grant:
--      exactly the insert branch of the single statement. Linear in the keys.
--
-- Plan caching: PL/pgSQL plans with the parameters as values for the first five calls of a
-- session and then compares with a generic plan; for this statement the custom plans looked
-- cheaper (the generic plan assumes ten array elements), so the plan cache kept planning on every
-- call. `plan_cache_mode = force_generic_plan` plans once per session. A generic plan cannot see
-- the array sizes or a table that grew since, so the plan must be right for any of them:
-- `b.key = ANY (keys)` bounds the scan of the buckets by the keys through the primary key, and
-- `enable_seqscan = off` keeps a generic plan made while the table was small from scanning it all
-- once it is large. Both settings apply only while the function runs.
--
-- search_path is pinned to the schema the buckets table is in (then pg_temp, last), set below
-- from where this migration created it, so a caller's search_path, or a table or function of the
-- same name elsewhere, cannot change what the function reads or writes.
--
-- Everything else is acquire.sql's as before: the exact numeric(38, 18) arithmetic of
-- tokenlease_refill and tokenlease_grantable, updated_at never rewound, rows with strict leases
-- refilled by tokenlease_refill_held (or tokenlease_available_held for a holder) and their entries
-- kept by tokenlease_hold, last_granted carrying the grant. The holder arrays (strict leases,
-- DESIGN.md §13) default to NULL: a plain take, for every key.

CREATE OR REPLACE FUNCTION tokenlease_acquire(
    keys        text[],
    capacities  numeric[],
    rates       numeric[],
    mins        numeric[],
    wants       numeric[],
    steps       numeric[],
    holders     bigint[]  DEFAULT NULL,
    lease_ids   bigint[]  DEFAULT NULL,
    kept        numeric[] DEFAULT NULL,
    lifetimes   bigint[]  DEFAULT NULL
) RETURNS TABLE (
    key        text,
    tokens     text,
    granted    text,
    updated_at timestamptz,
    store_now  timestamptz
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
BEGIN
    -- 1. Every key's row, in key order: new keys inserted full, existing ones locked.
    INSERT INTO tokenlease_buckets AS b
        (key, tokens, capacity, refill_per_second, updated_at, last_granted)
    SELECT r.key, r.capacity, r.capacity, r.rate, now(), 0
    FROM unnest(keys, capacities, rates) AS r(key, capacity, rate)
    ORDER BY r.key
    ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false;

    -- 2. Refill and take, joined by key.
    RETURN QUERY
    UPDATE tokenlease_buckets AS b
    SET (tokens, capacity, refill_per_second, updated_at, last_granted, leases) = (
            SELECT a.available - g.granted, req.capacity, req.rate,
                   greatest(b.updated_at, now()), g.granted,
                   CASE WHEN s.plain THEN b.leases
                        ELSE tokenlease_hold(b.leases, now(), req.holder, req.lease_id,
                                             req.kept + g.granted, req.lifetime_us)
                   END
            FROM (SELECT req.holder IS NULL AND cardinality(b.leases) = 0 AS plain) AS s
            CROSS JOIN LATERAL (
                SELECT CASE WHEN s.plain
                            THEN tokenlease_refill(b.tokens, req.capacity, req.rate,
                                                   b.updated_at, now())
                            WHEN req.holder IS NULL
                            THEN tokenlease_refill_held(b.tokens, req.capacity, req.rate,
                                                        b.updated_at, b.leases, now())
                            ELSE tokenlease_available_held(b.tokens, req.capacity, req.rate,
                                                           b.updated_at, b.leases, now(),
                                                           req.holder, req.kept)
                       END AS available
            ) AS a
            CROSS JOIN LATERAL (
                SELECT tokenlease_grantable(a.available, req.min_take, req.want, req.step)
                           AS granted
            ) AS g
        )
    FROM unnest(keys, capacities, rates, mins, wants, steps, holders, lease_ids, kept,
                lifetimes)
        AS req(key, capacity, rate, min_take, want, step, holder, lease_id, kept, lifetime_us)
    WHERE b.key = req.key
      AND b.key = ANY (keys)
    RETURNING b.key, b.tokens::text, b.last_granted::text, b.updated_at, now();
END
$$;

DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION tokenlease_acquire(text[], numeric[], numeric[], numeric[], numeric[], '
        'numeric[], bigint[], bigint[], numeric[], bigint[]) SET search_path = %I, pg_temp',
        (SELECT n.nspname
         FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.oid = 'tokenlease_buckets'::regclass));
END
$$;

COMMENT ON FUNCTION tokenlease_acquire(text[], numeric[], numeric[], numeric[], numeric[],
                                       numeric[], bigint[], bigint[], numeric[], bigint[]) IS
    'tokenlease refill and take for distinct keys, rows locked in key order: (key, tokens left, granted, updated_at, now())';

-- Return unused lease tokens, idempotently, for distinct keys: give_back.sql as a function, for
-- the same reasons and in the same two steps as tokenlease_acquire.
--
-- Each return id is recorded once (ON CONFLICT DO NOTHING); only ids recorded by this call
-- credit their bucket, so a retried return (whose first attempt may have committed unseen)
-- credits nothing. The credit refills first, then adds, capped at capacity less the tokens still
-- out on strict leases. A strict return settles its lease: the entry leaves the row, and the
-- credit is at most what the entry held, and nothing once the entry is gone (settled, replaced by
-- a later grant, or expired, when its tokens already came back through the refill). A bucket
-- with no row is full and stays full. Rows are locked in key order. One row per credited key.
CREATE OR REPLACE FUNCTION tokenlease_give_back(
    ids         bigint[],
    keys        text[],
    amounts     numeric[],
    capacities  numeric[],
    rates       numeric[],
    holders     bigint[] DEFAULT NULL,
    lease_ids   bigint[] DEFAULT NULL
) RETURNS SETOF text
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    fresh bigint[];
BEGIN
    -- 1. Record the ids, in id order.
    WITH recorded AS (
        INSERT INTO tokenlease_returns AS t (id, key, amount)
        SELECT r.id, r.key, r.amount
        FROM unnest(ids, keys, amounts) AS r(id, key, amount)
        ORDER BY r.id
        ON CONFLICT (id) DO NOTHING
        RETURNING t.id
    )
    SELECT array_agg(recorded.id) INTO fresh FROM recorded;
    IF fresh IS NULL THEN
        RETURN;
    END IF;
    IF cardinality(fresh) < cardinality(ids) THEN
        -- A retry: only the returns recorded now go on (rare, so the filter may be quadratic).
        SELECT array_agg(r.id), array_agg(r.key), array_agg(r.amount), array_agg(r.capacity),
               array_agg(r.rate), array_agg(r.holder), array_agg(r.lease_id)
        INTO ids, keys, amounts, capacities, rates, holders, lease_ids
        FROM unnest(ids, keys, amounts, capacities, rates, holders, lease_ids)
            AS r(id, key, amount, capacity, rate, holder, lease_id)
        WHERE r.id = ANY (fresh);
    END IF;

    -- 2. Every credited key's row, in key order: a missing bucket inserted full, others locked.
    INSERT INTO tokenlease_buckets AS b
        (key, tokens, capacity, refill_per_second, updated_at, last_granted)
    SELECT r.key, r.capacity, r.capacity, r.rate, now(), 0
    FROM unnest(keys, capacities, rates) AS r(key, capacity, rate)
    ORDER BY r.key
    ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false;

    -- 3. Refill, credit and settle, joined by key.
    RETURN QUERY
    UPDATE tokenlease_buckets AS b
    SET (tokens, capacity, refill_per_second, updated_at, last_granted, leases) = (
            SELECT least(CASE WHEN cardinality(s.leases) = 0 THEN credit.capacity
                              ELSE greatest(0, credit.capacity
                                               - tokenlease_outstanding(s.leases, now()))
                         END,
                         f.refilled + s.credited),
                   credit.capacity, credit.rate, greatest(b.updated_at, now()), 0, s.leases
            FROM (
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
        )
    FROM unnest(keys, amounts, capacities, rates, holders, lease_ids)
        AS credit(key, amount, capacity, rate, holder, lease_id)
    WHERE b.key = credit.key
      AND b.key = ANY (keys)
    RETURNING b.key;
END
$$;

DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION tokenlease_give_back(bigint[], text[], numeric[], numeric[], numeric[], '
        'bigint[], bigint[]) SET search_path = %I, pg_temp',
        (SELECT n.nspname
         FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.oid = 'tokenlease_buckets'::regclass));
END
$$;

COMMENT ON FUNCTION tokenlease_give_back(bigint[], text[], numeric[], numeric[], numeric[],
                                         bigint[], bigint[]) IS
    'tokenlease return of unused lease tokens, once per return id, rows locked in key order: the credited keys';
