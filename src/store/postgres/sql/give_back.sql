-- language=SQL
-- Return unused lease tokens, idempotently, for one or many keys: a call of tokenlease_give_back
-- (migrations/0004_acquire_function.sql), whose statements PostgreSQL plans once per session.
--
-- $1 int8[]  return ids (distinct; a retry reuses its id)
-- $2 text[]  keys (distinct)
-- $3 text[]  amounts
-- $4 text[]  capacities
-- $5 text[]  refill rates
-- $6 int8[]  holder of the strict lease being settled, or NULL (a relaxed lease)
-- $7 int8[]  that lease's id (strict only)
--
-- Only ids recorded by this call credit their bucket, so a retried return (whose first attempt
-- may have committed unseen) credits nothing. The credit refills first, then adds, capped at
-- capacity less the tokens still out on strict leases; a strict return settles its lease and
-- credits at most what the entry held, nothing once the entry is gone. A bucket with no row is
-- full and stays full. One row per credited key.
SELECT key
FROM tokenlease_give_back($1::int8[], $2::text[], $3::text[]::numeric[], $4::text[]::numeric[],
                          $5::text[]::numeric[], $6::int8[], $7::int8[]) AS key
