SELECT checksum FROM tokenlease_migrations WHERE version = $1
