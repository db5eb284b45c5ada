-- Migration 0004: dead letters of the consumer runner (see the PostgreSQL migration 0007).

CREATE TABLE IF NOT EXISTS {dead_letters} (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer     TEXT NOT NULL,
    message_id   TEXT NOT NULL,
    topic        TEXT NOT NULL,
    key          TEXT,
    headers      TEXT NOT NULL DEFAULT '{}',
    content_type TEXT NOT NULL,
    payload      BLOB NOT NULL,
    created_at   REAL,
    error        TEXT NOT NULL,
    attempts     INTEGER NOT NULL,
    held         INTEGER NOT NULL DEFAULT 0,
    failed_at    REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    UNIQUE (consumer, message_id)
);

CREATE INDEX IF NOT EXISTS dead_letters_key_idx ON {dead_letters} (consumer, key, seq);
