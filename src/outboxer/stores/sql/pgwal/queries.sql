-- WAL outbox queries. No table: a message is a transactional logical decoding message,
-- decoded (in commit order, only once its transaction committed) through a slot.

-- name: emit
-- Runs on the caller's connection, in the caller's transaction: the message is decoded
-- only if that transaction commits, at its commit's place in the WAL.
SELECT pg_logical_emit_message(true, CAST(:prefix AS text), CAST(:content AS bytea))
