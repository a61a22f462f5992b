-- A floor, not a take: the cheapest UPDATE of the key's row on the store's table (no column
-- changes value, no domain check), returning the take's six columns. Measured for docs/results.md
-- ("The one statement's cost on the server").
UPDATE tokenlease_buckets AS b SET tokens = b.tokens WHERE b.key = $1
RETURNING b.key, b.tokens, b.frac, b.refilled - b.tokens, b.updated_us, b.updated_us
