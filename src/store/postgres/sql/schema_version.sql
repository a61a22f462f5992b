SELECT max(version) FROM tokenlease_migrations WHERE version <= $1
