SELECT shardid, shard_name('tokenlease_buckets'::regclass, shardid)
FROM pg_dist_shard WHERE logicalrelid = to_regclass('tokenlease_buckets')
ORDER BY shardid
