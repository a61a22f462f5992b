INSERT INTO tokenlease_functions (file, checksum, generation) VALUES ($1, $2, $3)
ON CONFLICT (file) DO UPDATE
SET checksum = excluded.checksum, generation = excluded.generation, applied_at = now()
