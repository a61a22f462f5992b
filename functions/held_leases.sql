-- Strict leases: the entries a bucket row keeps for the leases it has out (the type
-- tokenlease_lease and the column are schema: migration 0003), and the arithmetic over them.

-- a SQL function into every statement that mentions it, even in a CASE branch that is never
-- taken, and planning subqueries over unnest would more than double the planning time of every
-- acquire statement, strict or not (measured: 0.15 ms to 0.40 ms a call; statements sent with
-- query_typed are planned on every call). And a subquery over unnest costs a function scan per
-- row: a refill of 256 strict keys took 23 ms with three of them per row, against 8 ms for the
-- same refill without leases. A loop is planned once per session and costs microseconds.

-- Tokens the live entries of `leases` hold at `at`.
CREATE OR REPLACE FUNCTION tokenlease_outstanding(leases tokenlease_lease[], at timestamptz)
RETURNS numeric
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    l tokenlease_lease;
    total numeric := 0;
BEGIN
    FOREACH l IN ARRAY leases LOOP
        IF l.expires_at > at THEN
            total := total + l.amount;
        END IF;
    END LOOP;
    RETURN total;
END
$$;

-- The refill of a bucket with leases out: tokens at `at` for a bucket that held `tokens` at
-- `updated_at`, never above capacity less the tokens still out on lease. With no lease entries
-- this is tokenlease_refill exactly.
--
-- Between two statements the outstanding total only falls (entries expire; only a statement
-- adds one), so the room under the cap only grows. The exact refill with a rising cap would
-- follow each step; this takes three terms whose least is never above it:
--   1. the plain refill, tokens + elapsed x rate (the cap never limits it more than this);
--   2. the cap now, capacity - outstanding(at);
--   3. if entries expired since updated_at: the cap as it stood at updated_at (the lowest it
--      has been since) plus the refill from the last of those expiries to `at`.
-- Never above the exact value, so never admits more than one bucket would; below it only for a
-- while after a lease expired unsettled (its holder died or could not reach the database).
CREATE OR REPLACE FUNCTION tokenlease_refill_held(
    tokens numeric, capacity numeric, rate numeric, updated_at timestamptz,
    leases tokenlease_lease[], at timestamptz
) RETURNS numeric
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    l tokenlease_lease;
    out_now numeric := 0;
    out_then numeric := 0;
    last_expiry timestamptz;
    refilled numeric := tokenlease_refill(tokens, capacity, rate, updated_at, at);
BEGIN
    FOREACH l IN ARRAY leases LOOP
        IF l.expires_at > at THEN
            out_now := out_now + l.amount;
        END IF;
        IF l.expires_at > updated_at THEN
            out_then := out_then + l.amount;
            IF l.expires_at <= at AND (last_expiry IS NULL OR l.expires_at > last_expiry) THEN
                last_expiry := l.expires_at;
            END IF;
        END IF;
    END LOOP;
    refilled := least(refilled, capacity - out_now);
    IF last_expiry IS NOT NULL THEN
        refilled := least(refilled,
                          capacity - out_then
                              + greatest(0, extract(epoch FROM (at - last_expiry))) * rate);
    END IF;
    RETURN greatest(0, refilled);
END
$$;

-- What a strict grant to `holder` may take from: the refilled bucket, less whatever the holder
-- claims to keep beyond its live entry (0 when holder is NULL).
CREATE OR REPLACE FUNCTION tokenlease_available_held(
    tokens numeric, capacity numeric, rate numeric, updated_at timestamptz,
    leases tokenlease_lease[], at timestamptz, holder bigint, kept numeric
) RETURNS numeric
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    l tokenlease_lease;
    own numeric := 0;
BEGIN
    IF holder IS NOT NULL THEN
        FOREACH l IN ARRAY leases LOOP
            IF l.holder = tokenlease_available_held.holder AND l.expires_at > at THEN
                own := own + l.amount;
            END IF;
        END LOOP;
    END IF;
    RETURN greatest(0, tokenlease_refill_held(tokens, capacity, rate, updated_at, leases, at)
                       - greatest(0, coalesce(kept, 0) - own));
END
$$;

-- The entries of `leases` still live at `at`, with `holder`'s entry replaced by a new one of
-- `amount` tokens under `lease_id` until `at + lifetime_us` (none when amount is 0). A NULL
-- holder (a plain take, or a relaxed lease) only drops expired entries. Sorted by holder.
CREATE OR REPLACE FUNCTION tokenlease_hold(
    leases tokenlease_lease[], at timestamptz, holder bigint, lease_id bigint, amount numeric,
    lifetime_us bigint
) RETURNS tokenlease_lease[]
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
DECLARE
    l tokenlease_lease;
    kept tokenlease_lease[] := '{}';
    placed boolean := holder IS NULL OR amount <= 0;
BEGIN
    FOREACH l IN ARRAY leases LOOP
        CONTINUE WHEN l.expires_at <= at;
        CONTINUE WHEN l.holder = tokenlease_hold.holder;
        IF NOT placed AND l.holder > tokenlease_hold.holder THEN
            kept := kept || ROW(tokenlease_hold.holder, tokenlease_hold.lease_id,
                                tokenlease_hold.amount,
                                at + lifetime_us * interval '1 microsecond')::tokenlease_lease;
            placed := true;
        END IF;
        kept := kept || l;
    END LOOP;
    IF NOT placed THEN
        kept := kept || ROW(tokenlease_hold.holder, tokenlease_hold.lease_id,
                            tokenlease_hold.amount,
                            at + lifetime_us * interval '1 microsecond')::tokenlease_lease;
    END IF;
    RETURN kept;
END
$$;

-- The entries of `leases` still live at `at`, less `holder`'s entry if it is lease `lease_id`
-- (a give-back settling that lease).
CREATE OR REPLACE FUNCTION tokenlease_release(
    leases tokenlease_lease[], at timestamptz, holder bigint, lease_id bigint
) RETURNS tokenlease_lease[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    l tokenlease_lease;
    kept tokenlease_lease[] := '{}';
BEGIN
    FOREACH l IN ARRAY leases LOOP
        CONTINUE WHEN l.expires_at <= at;
        CONTINUE WHEN l.holder = tokenlease_release.holder
                      AND l.lease_id = tokenlease_release.lease_id;
        kept := kept || l;
    END LOOP;
    RETURN kept;
END
$$;

-- What a give-back of lease `lease_id` by `holder` may credit: at most what the entry still
-- holds, and nothing when the entry is gone (already settled, replaced by a later grant, or
-- expired: an expired lease already stopped counting, so its tokens came back through the
-- refill and must not come back twice).
CREATE OR REPLACE FUNCTION tokenlease_release_credit(
    leases tokenlease_lease[], at timestamptz, holder bigint, lease_id bigint, amount numeric
) RETURNS numeric
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    l tokenlease_lease;
BEGIN
    FOREACH l IN ARRAY leases LOOP
        IF l.expires_at > at AND l.holder = tokenlease_release_credit.holder
           AND l.lease_id = tokenlease_release_credit.lease_id THEN
            RETURN least(tokenlease_release_credit.amount, l.amount);
        END IF;
    END LOOP;
    RETURN 0;
END
$$;
