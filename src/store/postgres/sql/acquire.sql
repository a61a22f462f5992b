-- language=SQL
-- Refill and take, for one or many keys, in one atomic statement: a call of tokenlease_acquire
-- (migrations/0004_acquire_function.sql), whose statements PostgreSQL plans once per session.
--
-- $1 text[]  keys (distinct)
-- $2 text[]  capacities   (decimal text)
-- $3 text[]  refill rates (tokens per second, decimal text)
-- $4 text[]  min:  take nothing unless this many tokens can be granted
-- $5 text[]  want: take up to this many
-- $6 text[]  step: grant a multiple of this (the cost, for coalesced takes of one cost)
--
-- One row per key: the key, tokens left, tokens granted, the refill time, and now().
SELECT key, tokens, granted, updated_at, store_now
FROM tokenlease_acquire($1::text[], $2::text[]::numeric[], $3::text[]::numeric[],
                        $4::text[]::numeric[], $5::text[]::numeric[], $6::text[]::numeric[])
