-- Migration 0001 of the partitioned layout (`outboxer schema apply --partitioned`): the
-- outbox table range-partitioned by created_at. Same name, columns, indexes and trigger
-- as migrations/0001_outbox.sql (their reasons are written there), so the write path and
-- the relay's statements are the same; what differs is written here.

-- The schema unless it exists: CREATE SCHEMA IF NOT EXISTS asks for the CREATE privilege on
-- the database even when it exists, which a role owning the schema its DBA made lacks.
DO $schema$ BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$;

CREATE TABLE {outbox} (
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
    -- The partition key: the writer's transaction start (now()), so the rows of one
    -- transaction share a partition.
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    -- A unique constraint of a partitioned table must hold the partition key. Rows of one
    -- transaction share created_at, so an id enqueued twice in one transaction is still
    -- refused; across transactions it is not (the README says so).
    CONSTRAINT {table_raw}_pkey PRIMARY KEY (id, destination, created_at)
) PARTITION BY RANGE (created_at);

-- Declared on the parent: every partition gets its own copy, made when it is attached.
-- Each is partial as in the default table, so a partition whose rows are all finished has
-- empty ready, blocking and leased indexes, and the claim's walk of them costs nothing.
CREATE INDEX {table_raw}_ready_idx ON {outbox} (destination, seq)
    WHERE status IN ('PENDING', 'FAILED', 'PROCESSING');
-- The default table's blocking index, in two: rows in flight or backing off (few: the
-- claim reads them all, once, migration 0006 of this layout), and ABANDONED rows (which
-- can be many: probed per key, and only when they block). Each row is in one at most.
CREATE INDEX {table_raw}_blocking_idx ON {outbox} (destination, key, seq)
    WHERE key IS NOT NULL AND status IN ('PROCESSING', 'FAILED');
CREATE INDEX {table_raw}_abandoned_idx ON {outbox} (destination, key, seq)
    WHERE key IS NOT NULL AND status = 'ABANDONED';
-- Retention drops partitions; this index answers its check that a partition holds no row
-- younger than its status's retention (and serves `outboxer messages`).
CREATE INDEX {table_raw}_finished_idx ON {outbox} (status, updated_at)
    WHERE status IN ('PUBLISHED', 'ABANDONED');

-- Rows whose time no partition covers land here, so a writer never fails for want of a
-- partition (maintenance late, a clock far ahead). Maintenance moves them into the
-- partition it creates for their time (outboxer.stores.pgpartitions). A partitioned table
-- has no storage parameters: each partition gets the default table's autovacuum settings.
CREATE TABLE {default_partition} PARTITION OF {outbox} DEFAULT;
ALTER TABLE {default_partition} SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05
);

-- As in migrations/0001_outbox.sql; migration 0003 replaces the trigger.
CREATE FUNCTION {schema}.{table_raw}_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify({channel_literal}, '');
    RETURN NULL;
END
$fn$;

CREATE TRIGGER {table_raw}_notify AFTER INSERT ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.{table_raw}_notify();

-- Retention drops whole partitions; nothing of outboxer deletes rows of this table.
-- outboxer versions without this layout delete finished rows by ctid, which names a row
-- only within one partition: on this table their cleanup could delete unfinished rows of
-- other partitions. So a DELETE on the table is refused, unless the session says it means
-- it (SET outboxer.allow_delete = on). Statement-level: nothing per row, and it does not
-- fire when an UPDATE moves a row to another partition.
CREATE FUNCTION {schema}.{table_raw}_refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF coalesce(current_setting('outboxer.allow_delete', true), '') = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'DELETE on the partitioned outbox % is refused', TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'retention drops whole partitions (outboxer cleanup); an outboxer '
                     'version without the partitioned layout must not run on this table. '
                     'To delete rows on purpose: SET outboxer.allow_delete = on';
END
$fn$;

CREATE TRIGGER {table_raw}_refuse_delete BEFORE DELETE ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.{table_raw}_refuse_delete();
