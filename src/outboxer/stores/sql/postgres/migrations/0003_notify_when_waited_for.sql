-- Migration 0003: notify only while a relay waits for it.
-- A NOTIFY costs every committing writer a turn on a cluster-wide queue lock. A relay
-- that is busy draining does not need it (it claims again at once), so writers notify
-- only while some relay has registered here that it is idle and listening.

-- Unlogged: a registration is worth nothing after a crash.
CREATE UNLOGGED TABLE {listeners} (
    relay       text PRIMARY KEY,
    until       timestamptz NOT NULL
);

DROP TRIGGER {table_raw}_notify ON {outbox};

CREATE OR REPLACE FUNCTION {schema}.{table_raw}_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF EXISTS (SELECT 1 FROM {listeners} WHERE until > now()) THEN
        -- Identical notifications of one transaction are folded into one.
        PERFORM pg_notify({channel_literal}, '');
    END IF;
    RETURN NULL;
END
$fn$;

-- Deferred to commit, so the check happens as late as possible: a relay that registers
-- and then looks once more for work cannot miss a writer that checked before it.
CREATE CONSTRAINT TRIGGER {table_raw}_notify AFTER INSERT ON {outbox}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION {schema}.{table_raw}_notify();
