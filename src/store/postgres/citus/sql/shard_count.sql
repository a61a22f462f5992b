SELECT (SELECT source FROM pg_settings WHERE name = 'citus.shard_count'),
       (SELECT count(*) FROM pg_dist_node
        WHERE noderole = 'primary' AND isactive AND shouldhaveshards)
