-- Migration 0004: status stays cheap on a big table (see the PostgreSQL migration 0008).
-- MySQL has no partial indexes: this one holds every row, and counts_tally reads the ranges
-- of the unfinished and ABANDONED statuses and of the PUBLISHED rows that needed more than
-- one attempt (status, then attempts), covered (destination and created_at follow), never
-- the PUBLISHED rows of a first attempt, which status estimates (queries.sql:
-- sample_published). The message lists need no new index: finished_idx is (status,
-- updated_at) and, as every InnoDB secondary index, ends with the primary key, seq.
-- MySQL has no CREATE INDEX IF NOT EXISTS (MariaDB has): the ALTER runs only when the index
-- is missing, so the migration can run again. InnoDB builds it in place; writers go on.
SET @outboxer_add_status_idx = IF(
    (SELECT COUNT(*) FROM information_schema.STATISTICS
     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{table_raw}' AND INDEX_NAME = 'status_idx') = 0,
    'ALTER TABLE {outbox} ADD KEY status_idx (status, attempts, destination, created_at)',
    'DO 0');
PREPARE outboxer_add_status_idx FROM @outboxer_add_status_idx;
EXECUTE outboxer_add_status_idx;
DEALLOCATE PREPARE outboxer_add_status_idx;
