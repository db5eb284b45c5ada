-- Migration 0005: status and the message lists stay cheap on a big table (see the PostgreSQL
-- migration 0008). SQLite has no INCLUDE: the counted columns follow the key. SQLite uses a
-- partial index only for a query whose WHERE clause contains the index's own condition, so
-- the queries repeat it word for word (queries.sql: counts_tally, list).

CREATE INDEX IF NOT EXISTS {table_raw}_status_idx
    ON {outbox} (status, updated_at, seq, destination, attempts, created_at)
    WHERE status <> 'PUBLISHED' OR attempts > 0;
