CREATE OR REPLACE FUNCTION tokenlease_citus_parts(keys text[])
RETURNS TABLE (shard bigint, buckets text, returns text, members integer[])
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT s.shard, min(s.k) AS probe, array_agg(s.n::integer ORDER BY s.n) AS members
        FROM (SELECT get_shard_id_for_distribution_column('tokenlease_buckets', u.k) AS shard,
                     u.k, u.n
              FROM unnest(keys) WITH ORDINALITY AS u(k, n)) AS s
        GROUP BY s.shard
        ORDER BY s.shard
    LOOP
        -- The shard's metadata lock (as Citus's executor takes it for a write), then its
        -- placement checked in a snapshot taken after it (tokenlease_citus_hold).
        PERFORM tokenlease_citus_hold(ARRAY[g.shard], NULL);
        shard := g.shard;
        buckets := shard_name('tokenlease_buckets'::regclass, g.shard);
        returns := shard_name('tokenlease_returns'::regclass,
                              get_shard_id_for_distribution_column('tokenlease_returns', g.probe));
        members := g.members;
        RETURN NEXT;
    END LOOP;
END
$fn$;
