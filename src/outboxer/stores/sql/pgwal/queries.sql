-- WAL outbox queries. No table: a message is a transactional logical decoding message,
-- decoded (in commit order, only once its transaction committed) through a slot.

-- name: emit
-- Runs on the caller's connection, in the caller's transaction: the message is decoded
-- only if that transaction commits, at its commit's place in the WAL.
SELECT pg_logical_emit_message(true, CAST(:prefix AS text), CAST(:content AS bytea))

-- name: slot_state
-- A slot's place, in bytes from the WAL's start (pg_lsn has no integer cast), and the WAL
-- it keeps (from its restart_lsn) and is behind (from its confirmed position) the WAL's end.
-- wal_status 'lost': the server removed WAL the slot still needed (max_slot_wal_keep_size)
-- and the slot can never be read again; keep_limit: max_slot_wal_keep_size in bytes (NULL
-- for -1, no limit), what safe_wal_size is measured against.
SELECT CAST(pg_wal_lsn_diff(confirmed_flush_lsn, '0/0') AS bigint) AS confirmed,
       CAST(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) AS bigint) AS retained,
       CAST(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) AS bigint) AS behind,
       wal_status, CAST(safe_wal_size AS bigint) AS safe_wal_size,
       NULLIF(pg_size_bytes(current_setting('max_slot_wal_keep_size')), -1) AS keep_limit
FROM pg_replication_slots WHERE slot_name = :slot

-- name: slots
-- The slots of one WAL outbox (their names start with its slot prefix and "_"), with
-- wal_status (reserved, extended, unreserved: at risk; lost: invalidated for good) and
-- safe_wal_size (WAL bytes that may still be written before the slot is invalidated;
-- NULL without max_slot_wal_keep_size).
SELECT slot_name, active_pid, CAST(confirmed_flush_lsn AS text) AS confirmed_flush_lsn,
       CAST(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) AS bigint) AS retained,
       CAST(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) AS bigint) AS behind,
       wal_status, CAST(safe_wal_size AS bigint) AS safe_wal_size
FROM pg_replication_slots
WHERE database = current_database() AND plugin = 'pgoutput' AND starts_with(slot_name, :prefix)
ORDER BY slot_name
