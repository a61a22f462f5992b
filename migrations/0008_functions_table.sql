-- The store's SQL functions leave the migrations: from this version their current definitions
-- are the files of functions/ (bucket.sql, held_leases.sql, acquire_held.sql), applied after the
-- migrations, in one transaction under the migration lock, whenever a file's checksum differs
-- from the one recorded here (src/store/postgres/functions.rs). Migrations from this one on
-- change the schema only, so the current body of every function is in one place; the function
-- definitions in migrations 0001 to 0007 are their history.
CREATE TABLE IF NOT EXISTS tokenlease_functions (
    file       text        PRIMARY KEY,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE tokenlease_functions IS
    'tokenlease function files applied: file name (functions/<file>.sql) and SHA-256 of its SQL';
