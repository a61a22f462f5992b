-- Setup (SETUP=scripts/statements/no-domains.sql) that puts plain bigint and integer columns in
-- place of the table's domains, to measure what the domain checks cost the one-key take
-- (docs/results.md, "The one statement's cost on the server"). Not a migration.
ALTER TABLE tokenlease_buckets
    ALTER COLUMN tokens TYPE bigint,
    ALTER COLUMN capacity TYPE bigint,
    ALTER COLUMN refill_per_second TYPE bigint,
    ALTER COLUMN refilled TYPE bigint,
    ALTER COLUMN frac TYPE integer;
