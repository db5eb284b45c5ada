-- Log mode, migration 0001: an append-only outbox. Rows are inserted once and never
-- updated; each reader (one per destination) keeps its own offset, so several
-- destinations read the same rows; retention drops whole daily partitions (no DELETE,
-- no dead tuples, no vacuum of the log itself).

-- The schema unless it exists: CREATE SCHEMA IF NOT EXISTS asks for the CREATE privilege on
-- the database even when it exists, which a role owning the schema its DBA made lacks.
DO $schema$ BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$;

CREATE TABLE {log} (
    -- Reading order is (order_xid, position). order_xid is the writing transaction's id
    -- (pg_current_xact_id()), or a larger one for a keyed row (see queries.sql: insert).
    -- Invariant that makes offsets safe: a row with order_xid below the reader's snapshot
    -- xmin belongs to a finished transaction (order_xid >= the writer's own xid), and a
    -- row not yet committed has order_xid >= that xmin, so it sorts after every offset
    -- a reader can have stored. A late commit is read late, never skipped.
    order_xid    xid8 NOT NULL,
    -- Taken after the key's row lock (queries.sql: insert): a key's rows that share an
    -- order_xid keep their commit order.
    position     bigint GENERATED ALWAYS AS IDENTITY,
    id           uuid NOT NULL,
    topic        text NOT NULL,
    key          text,
    payload      bytea NOT NULL,
    content_type text NOT NULL,
    headers      jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (created_at);

CREATE INDEX {log_raw}_order_idx ON {log} (order_xid, position);

-- Rows whose day has no partition yet land here; retention never drops it.
CREATE TABLE {default_partition} PARTITION OF {log} DEFAULT;

-- The last order_xid given to each key, locked by every writer of the key until it
-- commits: writers of one key take turns, and the later one orders after the earlier.
CREATE TABLE {keys} (
    key      text PRIMARY KEY,
    last_xid xid8 NOT NULL
);

-- One offset per reader: the last (order_xid, position) its broker confirmed.
CREATE TABLE {offsets} (
    reader     text PRIMARY KEY,
    order_xid  xid8 NOT NULL DEFAULT '0',
    position   bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
