-- Migration 0007: the claim-check sweep finds the rows of its objects through an index
-- (see the PostgreSQL migration 0011). The sweep's referenced (payload.sql, a page of up
-- to 1,000 object names at a time) scanned the whole table, history included, per page.
-- Partial: only claim-checked rows are in it, so writers of other rows pay nothing.
-- SQLite uses a partial index only when the query repeats its condition word for word
-- (payload.sql: referenced).

CREATE INDEX IF NOT EXISTS {table_raw}_claim_check_idx
    ON {outbox} (json_extract(headers, '$."outboxer-claim-check"'))
    WHERE json_extract(headers, '$."outboxer-claim-check"') IS NOT NULL;
