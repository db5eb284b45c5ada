-- Migration 0002: the inbox. A consumer records each message id it applied, in the same
-- transaction as its own writes, so a redelivered message is recognised and skipped.
-- One inbox per schema, shared by every outbox table in it.

CREATE TABLE IF NOT EXISTS {inbox} (
    consumer    text NOT NULL,
    message_id  uuid NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention deletes old entries oldest first.
CREATE INDEX IF NOT EXISTS inbox_received_idx ON {inbox} (received_at);
