CREATE OR REPLACE FUNCTION tokenlease_citus_take_held(
    route text, keys text[], capacities bigint[], rates bigint[], mins bigint[], wants bigint[],
    steps bigint[], holders bigint[], lease_ids bigint[], kept bigint[], lifetimes bigint[])
RETURNS TABLE (key text, tokens bigint, frac integer, granted bigint, updated_us bigint,
               now_us bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $fn$
DECLARE
    p record;
    at_us bigint := (extract(epoch FROM now()) * 1000000)::bigint;
BEGIN
    -- A strict lease a crash forgot would let its holder spend tokens the bucket no longer
    -- counts: this transaction commits durably even on the store's asynchronous sessions.
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        EXECUTE format({held_insert_shard}, p.buckets) USING keys, capacities, rates, at_us, p.members;
        RETURN QUERY EXECUTE format({held_update_shard}, p.buckets)
            USING keys, capacities, rates, mins, wants, steps, holders, lease_ids, kept,
                  lifetimes, at_us, p.members;
    END LOOP;
END
$fn$;
