-- Debezium layout, migration 0001: an outbox table that Debezium's outbox event router
-- (io.debezium.transforms.outbox.EventRouter) reads with its default settings. The first
-- five columns are the router's documented defaults, names and types: id (event id,
-- becomes the record's "id" header), aggregatetype (route.by.field: the topic is
-- outbox.event.<aggregatetype>), aggregateid (the record key: per-key order in a Kafka
-- partition), type, payload (the record value). The router ignores other columns unless
-- told to place them (table.fields.additional.placement).
-- Rows are only inserted (the router warns on updates and skips deletes); Debezium, not
-- outboxer's relay, publishes them. Retention deletes old rows (the router ignores those
-- deletes).

-- The schema unless it exists: CREATE SCHEMA IF NOT EXISTS asks for the CREATE privilege on
-- the database even when it exists, which a role owning the schema its DBA made lacks.
DO $schema$ BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$;

CREATE TABLE {debezium} (
    id            uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid   varchar(255) NOT NULL,
    type          varchar(255) NOT NULL,
    payload       jsonb,
    headers       jsonb NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX {debezium_raw}_created_idx ON {debezium} (created_at);
