SET LOCAL citus.multi_shard_modify_mode TO 'sequential'
