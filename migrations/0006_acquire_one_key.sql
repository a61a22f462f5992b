-- tokenlease_acquire without its locking step for one key whose row exists.
--
-- Migration 0004's function runs two statements: (1) an INSERT ... ON CONFLICT that inserts
-- missing rows and locks every row of the call in key order, so that two multi-key calls never
-- wait on each other in a cycle, then (2) the UPDATE that refills and takes. For a call of one
-- key, which is what direct mode sends at low load and what a sparse key's call is, there is no
-- order to keep: the UPDATE alone locks the one row. Step 1 was about 30% of such a call's
-- server time (3,000 calls in one DO loop, server CPU only: 484-488 ms with it, 328-342 ms
-- without; DESIGN.md section 5).
--
-- So a call of one key runs the UPDATE first. If that found the row, the call is done. If not
-- (a new key, or one the idle cleanup deleted as full), nothing was written or locked, and the
-- call goes on exactly as a call of many keys does: step 1 inserts or locks the row, and the
-- UPDATE runs again, now on a locked row. Between the two a concurrent call may insert the row;
-- step 1's ON CONFLICT then locks it, as it always did. A concurrent update of the row while the
-- first UPDATE waits for its lock is handled as in any READ COMMITTED update: the UPDATE re-reads
-- the newest version of the row and computes the refill and take from it.
--
-- Everything else, the arithmetic, the settings and the pinned search_path, is 0004's.

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
DECLARE
    rows_locked boolean := false;
BEGIN
    LOOP
        -- One key whose row exists: its update locks it, and nothing else is locked, so
        -- there is no order to keep and step 1 is not needed. A missing row (a new key, or
        -- one deleted as full) updates nothing and goes through step 1 like many keys do.
        IF rows_locked OR cardinality(keys) = 1 THEN
            -- 2. Refill and take, joined by key (after step 1 below, or first for one key).
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
            IF FOUND OR rows_locked THEN
                RETURN;
            END IF;
        END IF;

        -- 1. Every key's row, in key order: new keys inserted full, existing ones locked.
        INSERT INTO tokenlease_buckets AS b
            (key, tokens, capacity, refill_per_second, updated_at, last_granted)
        SELECT r.key, r.capacity, r.capacity, r.rate, now(), 0
        FROM unnest(keys, capacities, rates) AS r(key, capacity, rate)
        ORDER BY r.key
        ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false;
        rows_locked := true;
    END LOOP;
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
