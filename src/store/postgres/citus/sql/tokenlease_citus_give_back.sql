CREATE OR REPLACE FUNCTION tokenlease_citus_give_back(
    route text, ids bigint[], keys text[], amounts bigint[], capacities bigint[], rates bigint[],
    holders bigint[], lease_ids bigint[])
RETURNS TABLE (key text)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $fn$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        RETURN QUERY EXECUTE format({give_back_shard}, p.buckets, p.returns)
            USING ids, keys, amounts, capacities, rates, holders, lease_ids, p.members;
    END LOOP;
END
$fn$;
