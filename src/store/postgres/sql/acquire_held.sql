-- language=SQL
-- Refill and take with strict leases, for one or many keys, in one atomic statement: a call of
-- tokenlease_acquire (migrations/0004_acquire_function.sql) with the holders' fields.
--
-- acquire.sql does the same for requests without a holder; this statement serves any batch in
-- which at least one request holds a strict lease (the others pass NULL holders).
--
-- $1 to $6 as acquire.sql, then:
-- $7  int8[]  holder of a strict lease, or NULL (a plain take or a relaxed lease)
-- $8  int8[]  the new lease's id (strict only)
-- $9  text[]  tokens the holder keeps from its previous lease, which the new one carries on
-- $10 int8[]  how long the database counts the new lease, in microseconds
--
-- A strict request also settles the holder's previous lease in the same step: what the holder
-- spent of it is gone, what it keeps carries into the new entry (kept + granted), so a renewal is
-- one round trip. Should a holder claim to keep more than its live entry holds, the difference
-- is taken from the bucket. A new key is a full bucket less its grant and less what its holder
-- claims to keep.
SELECT key, tokens, granted, updated_at, store_now
FROM tokenlease_acquire($1::text[], $2::text[]::numeric[], $3::text[]::numeric[],
                        $4::text[]::numeric[], $5::text[]::numeric[], $6::text[]::numeric[],
                        $7::int8[], $8::int8[], $9::text[]::numeric[], $10::int8[])
