SELECT EXISTS (SELECT FROM pg_dist_partition
               WHERE logicalrelid = 'tokenlease_buckets'::regclass),
       EXISTS (SELECT FROM pg_dist_partition
               WHERE logicalrelid = 'tokenlease_returns'::regclass)
