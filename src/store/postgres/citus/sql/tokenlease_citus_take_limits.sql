CREATE OR REPLACE FUNCTION tokenlease_citus_take_limits(
    route text, keys text[], capacities bigint[], rates bigint[], mins bigint[], wants bigint[],
    steps bigint[], more_caps bigint[], more_rates bigint[], firsts integer[], counts integer[])
RETURNS TABLE (key text, tokens bigint, frac integer, granted bigint, updated_us bigint,
               now_us bigint, more_tokens bigint[], more_frac integer[])
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        RETURN QUERY EXECUTE format({take_limits_shard}, p.buckets)
            USING keys, capacities, rates, mins, wants, steps, more_caps, more_rates, firsts,
                  counts, p.members;
    END LOOP;
END
$fn$;
