-- rate-limiter-flexible's upsert (RateLimiterPostgres._upsert, not forced), on its own table
-- rlf(key varchar(255) PRIMARY KEY, points integer, expire bigint) that
-- scripts/statement-instructions.sh creates with 10,000 rows, with the one-key take's six
-- parameters: $1 the key, $2 the new expiry, $3 now (the rows never expire), $4-$6 unused.
INSERT INTO rlf VALUES ($1, 1, $2) ON CONFLICT(key) DO UPDATE SET points = CASE WHEN (rlf.expire <= $3 OR 1=0) THEN 1 ELSE rlf.points + (1) END, expire = CASE WHEN rlf.expire <= $3 THEN $2 ELSE rlf.expire END RETURNING points, expire
