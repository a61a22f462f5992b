-- tokenlease: return of unused lease tokens on one Citus worker (src/store/postgres/citus/sql.rs)
SELECT key FROM tokenlease_citus_give_back($1, $2, $3, $4, $5, $6, $7, $8)