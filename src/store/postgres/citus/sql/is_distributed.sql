SELECT EXISTS (SELECT FROM pg_dist_partition
               WHERE logicalrelid = to_regclass('tokenlease_buckets'))
