SELECT pg_advisory_xact_lock(8390042714202989921);
CREATE TABLE IF NOT EXISTS tokenlease_migrations (
    version     bigint      PRIMARY KEY,
    description text        NOT NULL,
    checksum    text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
