SET LOCAL citus.shard_count = {count}
