-- The consumer runner's dead letters (see the PostgreSQL file for what each block does).

-- name: insert
-- A repeated dead letter of the same message leaves the row as it is (the no-op update);
-- not INSERT IGNORE, which would turn other errors into warnings too.
INSERT INTO {dead_letters}
    (consumer, message_id, topic, `key`, headers, content_type, payload, created_at, error,
     attempts, held)
VALUES (:consumer, :message_id, :topic, :key, :headers, :content_type, :payload, :created_at,
        :error, :attempts, :held)
ON DUPLICATE KEY UPDATE seq = seq

-- name: inbox_kept
-- The batch transaction's first inbox claim, read just before its commit: there unless a
-- deadlock rolled the transaction back under a handler that caught it and went on (its
-- later statements then ran in a new transaction, which must not commit).
SELECT 1 AS kept FROM {inbox} WHERE consumer = :consumer AND message_id = :message_id

-- name: key_blocked
-- Byte for byte (queries.sql): utf8mb4_bin pads with spaces, so a dead letter of 'a '
-- held back 'a'. The plain equality keeps key_idx's seek.
SELECT 1 AS blocked FROM {dead_letters}
WHERE consumer = :consumer AND `key` = :key AND BINARY `key` = :key
LIMIT 1

-- name: list
SELECT seq, consumer, message_id, topic, `key`, headers, content_type, payload,
       created_at, error, attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer OR :consumer IS NULL
ORDER BY seq
LIMIT :limit

-- name: page_after
SELECT seq, consumer, message_id, topic, `key`, headers, content_type, payload,
       created_at, error, attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer AND seq > :after
ORDER BY seq
LIMIT :limit

-- name: seq_of
SELECT seq FROM {dead_letters} WHERE consumer = :consumer AND message_id = :message_id

-- name: one
SELECT seq, consumer, message_id, topic, `key`, headers, content_type, payload,
       created_at, error, attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer AND message_id = :message_id

-- name: key_blocked_before
-- Byte for byte, as key_blocked: 'a ' is not 'a' (utf8mb4_bin pads with spaces).
SELECT 1 AS blocked FROM {dead_letters}
WHERE consumer = :consumer AND `key` = :key AND BINARY `key` = :key AND seq < :seq
LIMIT 1

-- name: delete
DELETE FROM {dead_letters} WHERE consumer = :consumer AND message_id = :message_id

-- name: purge_consumer
DELETE FROM {dead_letters} WHERE consumer = :consumer

-- name: failed_again
UPDATE {dead_letters}
SET attempts = attempts + 1, error = :error, held = FALSE, failed_at = UTC_TIMESTAMP(6)
WHERE consumer = :consumer AND message_id = :message_id

-- name: suspect_attempt
-- A redelivered message's attempt, before its handler, in its own transaction with
-- suspect_deaths: inserted with deaths = 0, or one more death on the row an attempt that
-- never ended left. No RETURNING with ON DUPLICATE KEY UPDATE: suspect_deaths reads the
-- row next, in the same transaction, which the upsert's lock keeps from changing meanwhile.
-- Each attempt sets first_seen to now: it is when the latest attempt was recorded, so the
-- retention only deletes a row no attempt touched for a whole inbox_retention (the
-- PostgreSQL file says why).
INSERT INTO {inbox_suspects} (consumer, message_id) VALUES (:consumer, :message_id)
ON DUPLICATE KEY UPDATE deaths = deaths + 1, first_seen = UTC_TIMESTAMP(6)

-- name: suspect_deaths
-- After suspect_attempt, in its transaction: the deaths before this attempt.
SELECT deaths FROM {inbox_suspects} WHERE consumer = :consumer AND message_id = :message_id

-- name: suspect_delete
-- The attempt ended (applied, failed in-process, dead-lettered, or cut short by the
-- consumer's own shutdown) -> the row is gone.
DELETE FROM {inbox_suspects} WHERE consumer = :consumer AND message_id = :message_id
