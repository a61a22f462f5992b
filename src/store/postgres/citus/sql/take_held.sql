-- tokenlease: refill and take with strict leases on one Citus worker (src/store/postgres/citus/sql.rs)
SELECT key, tokens, frac, granted, updated_us, now_us
FROM tokenlease_citus_take_held($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)