SELECT version, checksum FROM tokenlease_migrations ORDER BY version
