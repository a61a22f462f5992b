SELECT extversion FROM pg_extension WHERE extname = 'citus'
