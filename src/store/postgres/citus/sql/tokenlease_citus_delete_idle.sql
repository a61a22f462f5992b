CREATE OR REPLACE FUNCTION tokenlease_citus_delete_idle(route text, max_rows bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    s record;
    deleted bigint := 0;
    n bigint;
BEGIN
    FOR s IN
        SELECT shard_name('tokenlease_buckets'::regclass, b.shardid) AS buckets,
               shard_name('tokenlease_returns'::regclass, r.shardid) AS returns
        FROM pg_dist_shard AS b
        JOIN pg_dist_shard AS r ON r.logicalrelid = 'tokenlease_returns'::regclass
                                AND r.shardminvalue = b.shardminvalue
        JOIN pg_dist_placement AS p ON p.shardid = b.shardid
        WHERE b.logicalrelid = 'tokenlease_buckets'::regclass
          AND p.groupid = (SELECT l.groupid FROM pg_dist_local_group AS l)
        ORDER BY b.shardid
    LOOP
        EXIT WHEN deleted >= max_rows;
        EXECUTE format({delete_idle_shard}, s.buckets, s.returns) USING max_rows - deleted;
        GET DIAGNOSTICS n = ROW_COUNT;
        deleted := deleted + n;
    END LOOP;
    RETURN deleted;
END
$fn$;
