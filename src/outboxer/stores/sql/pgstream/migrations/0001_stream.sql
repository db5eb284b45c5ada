-- The stream relays' own tables (log mode and the WAL outbox), migration 0001.
--
-- A stream has no per-message status: a reader (log) or a slot (WAL) only stores the place
-- after the last message its broker confirmed. These two tables hold what a place cannot:
-- how often a message failed, and the messages given up on. A stream is (mode, destination);
-- an entry is named by its place in the stream, ``seq`` (the log row's position, the WAL
-- record's LSN), which reading it again gives back unchanged: a caller-chosen message id
-- used twice never merges two messages.

-- The schema unless it exists: CREATE SCHEMA IF NOT EXISTS asks for the CREATE privilege on
-- the database even when it exists, which a role owning the schema its DBA made lacks.
DO $schema$ BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$;

-- Messages that failed and are not yet past the stream's checkpoint. Written in one
-- statement per failed attempt (record_failure); the row goes when the checkpoint passes
-- its message (published at last, or dead-lettered). A restart reads the attempts back, so
-- a poison message is not given max_attempts tries afresh by every new relay.
CREATE TABLE {stream_failures} (
    mode         text NOT NULL,
    destination  text NOT NULL,
    seq          bigint NOT NULL,
    message_id   uuid NOT NULL,
    attempts     integer NOT NULL,
    last_error   text NOT NULL,
    -- WAL mode only: the slot position the relay was about to advance to when this
    -- message was settled. The advance cannot join a transaction; once the slot is at or
    -- past it the row is stale and is deleted (see queries.sql: mark_passing).
    pass_lsn     bigint,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (mode, destination, seq)
);

-- Messages the stream went past without publishing: attempts used up or refused for good,
-- or (abandoned_blocks_key) held behind such a message of their key. Written before (log:
-- in the same transaction as) the checkpoint moves past them, idempotent on (mode,
-- destination, seq); replayed or purged by `outboxer stream-relay dead-letters`.
CREATE TABLE {stream_dead_letters} (
    mode         text NOT NULL,
    destination  text NOT NULL,
    seq          bigint NOT NULL,
    message_id   uuid NOT NULL,
    topic        text NOT NULL,
    key          text,
    payload      bytea NOT NULL,
    content_type text NOT NULL,
    headers      jsonb NOT NULL DEFAULT '{}',
    error        text NOT NULL,
    attempts     integer NOT NULL,
    -- True: never attempted itself, held behind an earlier dead letter of its key.
    held         boolean NOT NULL DEFAULT false,
    created_at   timestamptz,
    failed_at    timestamptz NOT NULL DEFAULT now(),
    -- Replay order: the order the relay wrote them in, which is the stream's order.
    letter_seq   bigint GENERATED ALWAYS AS IDENTITY,
    PRIMARY KEY (mode, destination, seq)
);

CREATE INDEX {stream_dead_letters_raw}_key_idx
    ON {stream_dead_letters} (mode, destination, key) WHERE key IS NOT NULL;
CREATE INDEX {stream_dead_letters_raw}_id_idx
    ON {stream_dead_letters} (mode, destination, message_id);
