-- update-trivial.sql on the narrow table of narrow-table.sql (a floor, not a take).
UPDATE narrow AS b SET tokens = b.tokens WHERE b.key = $1
RETURNING b.key, b.tokens, b.frac, 0, b.updated_us, b.updated_us
