-- Function files get a generation, so that an older release never puts back its own definitions
-- over a newer release's.
--
-- `migrate` applies a file of functions/ whenever the checksum recorded for it differs from its
-- own (src/store/postgres/functions.rs). During a rolling deploy an instance of the older release
-- that starts, or runs `migrate`, after the newer one did would therefore apply its older
-- definitions again, and the two releases would take turns. From this version each file has a
-- generation, raised by a release that changes the file; a build applies a file when the
-- database records an older generation (or none), or the same generation with another checksum
-- (a definition edited by hand is restored), and leaves a newer generation alone. Builds from
-- before this migration write rows without a generation (0 here), which any build from this one
-- on replaces with its own. Adding a column with a constant default rewrites nothing: the lock
-- is brief, and this table is read only by `migrate`, never by a decision.
ALTER TABLE tokenlease_functions ADD COLUMN IF NOT EXISTS generation integer NOT NULL DEFAULT 0;

COMMENT ON COLUMN tokenlease_functions.generation IS
    'the generation of the file last applied (0: applied by a build from before migration 0009); a build applies a file only over an older generation, or the same one with another checksum';
