-- The consumer runner's dead letters (see the PostgreSQL file for what each block does).

-- name: insert
INSERT INTO {dead_letters}
    (consumer, message_id, topic, key, headers, content_type, payload, created_at, error,
     attempts, held)
VALUES (:consumer, :message_id, :topic, :key, :headers, :content_type, :payload, :created_at,
        :error, :attempts, :held)
ON CONFLICT (consumer, message_id) DO NOTHING

-- name: key_blocked
SELECT 1 AS blocked FROM {dead_letters} WHERE consumer = :consumer AND key = :key LIMIT 1

-- name: list
SELECT seq, consumer, message_id, topic, key, headers, content_type, payload, created_at, error,
       attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer OR :consumer IS NULL
ORDER BY seq
LIMIT :limit

-- name: page_after
SELECT seq, consumer, message_id, topic, key, headers, content_type, payload, created_at, error,
       attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer AND seq > :after
ORDER BY seq
LIMIT :limit

-- name: seq_of
SELECT seq FROM {dead_letters} WHERE consumer = :consumer AND message_id = :message_id

-- name: one
SELECT seq, consumer, message_id, topic, key, headers, content_type, payload, created_at, error,
       attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer AND message_id = :message_id

-- name: key_blocked_before
SELECT 1 AS blocked FROM {dead_letters}
WHERE consumer = :consumer AND key = :key AND seq < :seq
LIMIT 1

-- name: delete
DELETE FROM {dead_letters} WHERE consumer = :consumer AND message_id = :message_id

-- name: purge_consumer
DELETE FROM {dead_letters} WHERE consumer = :consumer

-- name: failed_again
UPDATE {dead_letters}
SET attempts = attempts + 1, error = :error, held = 0,
    failed_at = (julianday('now') - 2440587.5) * 86400.0
WHERE consumer = :consumer AND message_id = :message_id

-- name: write_lock
-- The first statement of a transaction that Django began (SQLite's deferred BEGIN; the
-- consumer's own session begins IMMEDIATE): a write that changes nothing, so the
-- transaction takes the write lock now, waiting busy_timeout for another writer. Once a
-- read came first (the dead-letter check), SQLite answers "database is locked" at once.
DELETE FROM {inbox} WHERE 0

-- name: suspect_attempt
-- A redelivered message's attempt, before its handler, in its own transaction: inserted with
-- deaths = 0, or one more death on the row an attempt that never ended left. Returns the
-- deaths before this attempt; one statement (the PostgreSQL file says why). Each attempt
-- sets first_seen to now (the column's default, in seconds since the epoch): it is when the
-- latest attempt was recorded, so the retention only deletes a row no attempt touched for a
-- whole inbox_retention (the PostgreSQL file says why).
INSERT INTO {inbox_suspects} (consumer, message_id) VALUES (:consumer, :message_id)
ON CONFLICT (consumer, message_id) DO UPDATE
SET deaths = deaths + 1, first_seen = (julianday('now') - 2440587.5) * 86400.0
RETURNING deaths

-- name: suspect_delete
-- The attempt ended (applied, failed in-process, dead-lettered, or cut short by the
-- consumer's own shutdown) -> the row is gone.
DELETE FROM {inbox_suspects} WHERE consumer = :consumer AND message_id = :message_id
