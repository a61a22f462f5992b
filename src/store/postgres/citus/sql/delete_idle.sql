-- tokenlease: idle cleanup on one Citus worker (src/store/postgres/citus/sql.rs)
SELECT tokenlease_citus_delete_idle($1, $2)