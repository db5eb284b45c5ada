-- Migration 0001: the outbox table (SQLite). Times are Unix seconds (REAL).
-- SQLite has one writer at a time, so seq order is commit order and no horizon is needed.

CREATE TABLE {outbox} (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT NOT NULL,
    destination     TEXT NOT NULL DEFAULT 'default',
    topic           TEXT NOT NULL,
    key             TEXT,
    payload         BLOB NOT NULL,
    content_type    TEXT NOT NULL,
    headers         TEXT NOT NULL DEFAULT '{}',
    status          TEXT NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'PROCESSING', 'PUBLISHED', 'FAILED', 'ABANDONED')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    last_error      TEXT,
    locked_by       TEXT,
    locked_until    REAL,
    created_at      REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    updated_at      REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    published_at    REAL,
    UNIQUE (id, destination)
);

-- See the PostgreSQL schema for why each index exists.
CREATE INDEX {table_raw}_ready_idx ON {outbox} (destination, seq)
    WHERE status IN ('PENDING', 'FAILED', 'PROCESSING');
CREATE INDEX {table_raw}_blocking_idx ON {outbox} (destination, key, seq)
    WHERE key IS NOT NULL AND status IN ('PROCESSING', 'FAILED', 'ABANDONED');
CREATE INDEX {table_raw}_finished_idx ON {outbox} (status, updated_at)
    WHERE status IN ('PUBLISHED', 'ABANDONED');
