-- Migration 0001: the outbox table, its indexes and the wake-up trigger.
-- Tokens in braces are replaced with quoted names from the settings.

-- The schema unless it exists: CREATE SCHEMA IF NOT EXISTS asks for the CREATE privilege on
-- the database even when it exists, which a role owning the schema its DBA made lacks.
DO $schema$ BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$;

CREATE TABLE {outbox} (
    -- Publish order. Sequence values are taken before commit, so across transactions
    -- seq is not commit order; for one key it is, because the insert query holds a
    -- per-key lock until commit before it takes the value (see queries.sql: insert).
    -- No index of its own: the only index that orders by seq is the partial ready index,
    -- so the planner cannot walk the published history to find the backlog.
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    id              uuid NOT NULL,
    destination     text NOT NULL DEFAULT 'default',
    topic           text NOT NULL,
    key             text,
    payload         bytea NOT NULL,
    content_type    text NOT NULL,
    headers         jsonb NOT NULL DEFAULT '{}',
    status          text NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'PROCESSING', 'PUBLISHED', 'FAILED', 'ABANDONED')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    locked_by       text,
    locked_until    timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    -- One copy of a message per destination; a caller-chosen id cannot be enqueued twice.
    CONSTRAINT {table_raw}_pkey PRIMARY KEY (id, destination)
);

-- The claim walks unfinished rows of one destination in publish order. Partial, so the
-- index is as small as the backlog, however many published rows retention still keeps.
CREATE INDEX {table_raw}_ready_idx ON {outbox} (destination, seq)
    WHERE status IN ('PENDING', 'FAILED', 'PROCESSING');

-- The rows that can hold back later rows of their key: in flight, backing off, or abandoned
-- (when abandoned rows block). Few rows match, so the per-candidate probe is cheap.
CREATE INDEX {table_raw}_blocking_idx ON {outbox} (destination, key, seq)
    WHERE key IS NOT NULL AND status IN ('PROCESSING', 'FAILED', 'ABANDONED');

-- Retention deletes finished rows oldest first, per status.
CREATE INDEX {table_raw}_finished_idx ON {outbox} (status, updated_at)
    WHERE status IN ('PUBLISHED', 'ABANDONED');

-- An outbox churns: every row is inserted, updated twice and deleted. Vacuum it early.
ALTER TABLE {outbox} SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05
);

-- Wake idle relays on commit. FOR EACH STATEMENT fires once per INSERT statement, not per
-- row, and PostgreSQL folds identical notifications of one transaction into one, so a
-- transaction that enqueues many messages sends one NOTIFY.
CREATE FUNCTION {schema}.{table_raw}_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify({channel_literal}, '');
    RETURN NULL;
END
$fn$;

CREATE TRIGGER {table_raw}_notify AFTER INSERT ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.{table_raw}_notify();
