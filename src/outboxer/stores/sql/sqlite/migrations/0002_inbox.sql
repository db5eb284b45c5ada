-- Migration 0002: the inbox (see the PostgreSQL migration).

CREATE TABLE IF NOT EXISTS {inbox} (
    consumer    TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    received_at REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX IF NOT EXISTS inbox_received_idx ON {inbox} (received_at);
