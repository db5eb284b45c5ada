-- Migration 0007: dead letters of the consumer runner (outboxer.Consumer). A message whose
-- handler failed max_attempts times is recorded here, in the consumer's own database, and
-- then acknowledged to the broker; `outboxer dead-letters replay` applies it later.
-- One table per schema, shared by every consumer group (column consumer), like the inbox.

CREATE TABLE IF NOT EXISTS {dead_letters} (
    -- Arrival order: a replay applies a key's dead letters in this order.
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer     text NOT NULL,
    message_id   uuid NOT NULL,
    topic        text NOT NULL,
    key          text,
    headers      jsonb NOT NULL DEFAULT '{}'::jsonb,
    content_type text NOT NULL,
    payload      bytea NOT NULL,
    created_at   timestamptz,
    -- The handler's last error (or why the message could not be read, or that it was held
    -- back behind an earlier dead letter of its key) and how many attempts failed.
    error        text NOT NULL,
    attempts     integer NOT NULL,
    -- True: never attempted, only held back because an earlier message of its key is here
    -- (abandoned_blocks_key); it goes back with that message on replay.
    held         boolean NOT NULL DEFAULT false,
    failed_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer, message_id)
);

-- Whether a key has dead letters (abandoned_blocks_key), and a key's dead letters in order.
CREATE INDEX IF NOT EXISTS dead_letters_key_idx ON {dead_letters} (consumer, key, seq);
