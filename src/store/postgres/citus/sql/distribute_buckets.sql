SELECT create_distributed_table('tokenlease_buckets', 'key', 'hash')
