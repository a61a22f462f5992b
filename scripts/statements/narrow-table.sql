-- Setup for the narrow-* candidates (SETUP=scripts/statements/narrow-table.sql): a copy of the
-- buckets table without the strict leases' array, without `refilled` and without domains, with
-- the same 10,000 full buckets. Measured for docs/results.md ("The one statement's cost on the
-- server"): whether the row's width and domains set the floor of an UPDATE.
CREATE TABLE narrow (
    key text PRIMARY KEY, tokens bigint NOT NULL, frac integer NOT NULL,
    capacity bigint NOT NULL, refill_per_second bigint NOT NULL, updated_us bigint NOT NULL);
INSERT INTO narrow
SELECT 'pgbench:' || i, 100000000000, 0, 100000000000, 50000000000,
       (extract(epoch FROM now()) * 1000000)::bigint
FROM generate_series(1, 10000) AS i;
