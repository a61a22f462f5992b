CREATE OR REPLACE FUNCTION tokenlease_citus_hold(shards bigint[], keys text[])
RETURNS text[]
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $fn$
DECLARE
    placed bigint;
BEGIN
    -- lock_shard_metadata returns void, never NULL: the condition only takes the locks.
    IF pg_catalog.lock_shard_metadata(5, shards) IS NULL THEN
        NULL;
    END IF;
    PERFORM FROM pg_catalog.pg_dist_placement AS p
    WHERE p.shardid OPERATOR(pg_catalog.=) ANY (shards)
      AND p.groupid OPERATOR(pg_catalog.=)
          (SELECT l.groupid FROM pg_catalog.pg_dist_local_group AS l);
    GET DIAGNOSTICS placed = ROW_COUNT;
    IF placed OPERATOR(pg_catalog.<) pg_catalog.cardinality(shards) THEN
        RAISE EXCEPTION 'tokenlease: shard of % has no placement on this node', shards
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'the shard map changed (a move, a split, a rebalance): the store reads it again';
    END IF;
    RETURN keys;
END
$fn$;
