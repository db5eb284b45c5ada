-- Migration 0008: suspects of the consumer runner (see the PostgreSQL migration 0012).

CREATE TABLE IF NOT EXISTS {inbox_suspects} (
    consumer    TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    deaths      INTEGER NOT NULL DEFAULT 0,
    first_seen  REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    PRIMARY KEY (consumer, message_id)
);
