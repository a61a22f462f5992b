ALTER TABLE tokenlease_returns DROP CONSTRAINT IF EXISTS tokenlease_returns_pkey;
ALTER TABLE tokenlease_returns ADD CONSTRAINT tokenlease_returns_pkey PRIMARY KEY (key, id);
SELECT create_distributed_table('tokenlease_returns', 'key', 'hash',
                                colocate_with := 'tokenlease_buckets');
