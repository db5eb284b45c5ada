-- Migration 0002: leases, renewed while a batch is in flight and fenced by a token; rows
-- of a relay that died are recovered one at a time (see the PostgreSQL migration 0006 and
-- queries.sql: claim_expired, renew, settle_*).
--
-- `lease`: the token of the claim that holds the row (a UUID as text, like id); settles
-- and renewals match it. lease_idx: the claim's look for expired leases, a range of rows
-- whose locked_until is set (only rows in flight have one: every statement that ends a
-- PROCESSING state clears it), so NULLs, every row at rest, are never read.
-- MySQL has no ADD COLUMN IF NOT EXISTS (MariaDB has): the ALTER runs only when the column
-- is missing, so the migration can run again. One ALTER adds both, or neither. InnoDB adds
-- a nullable column and an index in place, writers go on meanwhile.
SET @outboxer_add_lease = IF(
    (SELECT COUNT(*) FROM information_schema.COLUMNS
     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{table_raw}' AND COLUMN_NAME = 'lease') = 0,
    'ALTER TABLE {outbox} ADD COLUMN lease CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NULL, ADD KEY lease_idx (destination, locked_until)',
    'DO 0');
PREPARE outboxer_add_lease FROM @outboxer_add_lease;
EXECUTE outboxer_add_lease;
DEALLOCATE PREPARE outboxer_add_lease;
