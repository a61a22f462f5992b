SELECT s.shardid, s.shardminvalue::integer, s.shardmaxvalue::integer,
       n.groupid, n.nodeid, n.nodename, n.nodeport,
       shard_name('tokenlease_buckets'::regclass, s.shardid)
FROM pg_dist_shard AS s
JOIN pg_dist_placement AS p ON p.shardid = s.shardid
JOIN pg_dist_node AS n ON n.groupid = p.groupid AND n.noderole = 'primary'
WHERE s.logicalrelid = 'tokenlease_buckets'::regclass
ORDER BY s.shardminvalue::integer
