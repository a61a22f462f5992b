INSERT INTO tokenlease_migrations (version, description, checksum) VALUES ($1, $2, $3)
