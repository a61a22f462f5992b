CREATE OR REPLACE FUNCTION tokenlease_citus_give_back_limits(
    route text, ids bigint[], keys text[], amounts bigint[], capacities bigint[], rates bigint[],
    more_caps bigint[], more_rates bigint[], firsts integer[], counts integer[])
RETURNS TABLE (key text)
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        RETURN QUERY EXECUTE format({give_back_limits_shard}, p.buckets, p.returns)
            USING ids, keys, amounts, capacities, rates, more_caps, more_rates, firsts, counts,
                  p.members;
    END LOOP;
END
$fn$;
