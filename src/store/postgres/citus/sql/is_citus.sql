SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')
   AND to_regclass('pg_dist_partition') IS NOT NULL
