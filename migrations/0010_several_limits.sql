-- Plans of several limits on one key ("10 a second and 10,000 a day"), taken from together.
--
-- A key keeps one row. Its first limit (the one of the smallest capacity) stays in the columns
-- every row has, so every row written before this migration is a bucket of one limit, and the
-- statements for plans of one limit are unchanged. The other limits of a plan of several are
-- in four arrays, element i for the plan's limit i + 1 (src/store/postgres/limits.rs):
--
--   more_tokens    whole nanotokens in each other limit at updated_us
--   more_frac      the femtotokens below that, as frac
--   more_capacity  each other limit's capacity (nanotokens), as the last request gave it
--   more_rate      each other limit's rate (nanotokens per second), likewise
--
-- NULL (every row written by a plan of one limit) means no other limit; a limit a row does not
-- hold is full, as an absent row is. All limits of a row share updated_us: they are refilled
-- together, under the one row lock of the statement that takes from all of them.
--
-- Deploy path. ADD COLUMN without a default changes only the catalog: no row is rewritten,
-- whatever the table holds, and the ACCESS EXCLUSIVE lock it takes is held for an instant (a
-- take waits at most for the statements already running on the table). Instances of the
-- previous release keep working: they never name these columns, and their statements insert
-- rows with them NULL.
ALTER TABLE tokenlease_buckets
    ADD COLUMN IF NOT EXISTS more_tokens tokenlease_nanotokens[],
    ADD COLUMN IF NOT EXISTS more_frac tokenlease_femtotokens[],
    ADD COLUMN IF NOT EXISTS more_capacity tokenlease_capacity[],
    ADD COLUMN IF NOT EXISTS more_rate tokenlease_rate[];

COMMENT ON COLUMN tokenlease_buckets.more_tokens IS
    'whole nanotokens of each limit beyond the first at updated_us (NULL: a bucket of one limit)';
COMMENT ON COLUMN tokenlease_buckets.more_frac IS
    'femtotokens below one nanotoken of each limit beyond the first';
COMMENT ON COLUMN tokenlease_buckets.more_capacity IS
    'nanotokens: the capacity of each limit beyond the first';
COMMENT ON COLUMN tokenlease_buckets.more_rate IS
    'nanotokens per second: the rate of each limit beyond the first';
