-- The stream relays' failures and dead letters (see migrations/0001_stream.sql).
-- A stream is (mode, destination); every statement names both.

-- name: failures
-- The failed messages a relay takes over at start. In WAL mode, rows whose pass_lsn the
-- slot has reached are stale (their message is behind the slot: see mark_passing).
SELECT seq, message_id, attempts, last_error
FROM {stream_failures}
WHERE mode = :mode AND destination = :destination
  AND (pass_lsn IS NULL OR CAST(:passed AS bigint) IS NULL OR pass_lsn > CAST(:passed AS bigint))

-- name: record_failure
-- One statement per failed attempt: the count survives a restart, so a poison message
-- gets max_attempts tries in all, not per relay process.
INSERT INTO {stream_failures} AS f (mode, destination, seq, message_id, attempts, last_error)
VALUES (:mode, :destination, :seq, CAST(:message_id AS uuid), 1, :error)
ON CONFLICT (mode, destination, seq) DO UPDATE
SET attempts = f.attempts + 1, last_error = EXCLUDED.last_error, updated_at = now()
RETURNING attempts

-- name: insert_letter
-- Idempotent on the entry: the WAL relay writes a dead letter before it advances the slot,
-- and a relay that died in between writes it again after its restart.
INSERT INTO {stream_dead_letters}
    (mode, destination, seq, message_id, topic, key, payload, content_type, headers,
     error, attempts, held, created_at)
VALUES (:mode, :destination, :seq, CAST(:message_id AS uuid), :topic, :key, :payload,
        :content_type, CAST(:headers AS jsonb), :error, :attempts, :held, :created_at)
ON CONFLICT (mode, destination, seq) DO NOTHING

-- name: clear_failures
-- Log mode: in the transaction that moves the reader's offset past these messages.
DELETE FROM {stream_failures}
WHERE mode = :mode AND destination = :destination AND seq = ANY(CAST(:seqs AS bigint[]))

-- name: mark_passing
-- WAL mode, before the slot advance (which cannot join a transaction): these rows become
-- stale once the slot reaches :lsn. A relay that dies after the advance leaves them, and
-- the next advance (drop_passed), or the next start (failures), passes over them; one
-- that dies before it still finds them, and their messages, after its restart.
UPDATE {stream_failures} SET pass_lsn = :lsn
WHERE mode = :mode AND destination = :destination AND seq = ANY(CAST(:seqs AS bigint[]))

-- name: drop_passed
-- WAL mode, after the slot advanced to :lsn.
DELETE FROM {stream_failures}
WHERE mode = :mode AND destination = :destination AND pass_lsn <= :lsn

-- name: held_keys
-- Which of these keys have a dead letter in the stream (abandoned_blocks_key holds them).
SELECT DISTINCT key FROM {stream_dead_letters}
WHERE mode = :mode AND destination = :destination AND key = ANY(CAST(:keys AS text[]))

-- name: all_held_keys
SELECT DISTINCT key FROM {stream_dead_letters}
WHERE mode = :mode AND destination = :destination AND key IS NOT NULL

-- name: list_letters
-- Oldest first: the order they were written in, which is the stream's order.
SELECT destination, seq, message_id, topic, key, payload, content_type,
       CAST(headers AS text) AS headers, error, attempts, held, created_at, failed_at
FROM {stream_dead_letters}
WHERE mode = :mode AND (CAST(:destination AS text) IS NULL OR destination = :destination)
ORDER BY letter_seq
LIMIT :limit

-- name: delete_letter
-- Replay: the broker confirmed the letter's message.
DELETE FROM {stream_dead_letters}
WHERE mode = :mode AND destination = :destination AND seq = :seq

-- name: letter_failed_again
-- Replay: one more attempt, its error; a held letter that was tried is held no more.
UPDATE {stream_dead_letters}
SET attempts = attempts + 1, error = :error, held = false, failed_at = now()
WHERE mode = :mode AND destination = :destination AND seq = :seq

-- name: purge_all
DELETE FROM {stream_dead_letters} WHERE mode = :mode AND destination = :destination

-- name: purge_ids
DELETE FROM {stream_dead_letters}
WHERE mode = :mode AND destination = :destination
  AND message_id = ANY(CAST(:ids AS uuid[]))

-- name: letter_counts
SELECT destination, count(*) AS letters, count(*) FILTER (WHERE held) AS held,
       min(failed_at) AS oldest
FROM {stream_dead_letters} WHERE mode = :mode GROUP BY destination

-- name: failure_counts
SELECT destination, count(*) AS failing, max(attempts) AS most_attempts
FROM {stream_failures} WHERE mode = :mode AND pass_lsn IS NULL GROUP BY destination

-- name: tables
SELECT to_regclass(:failures) IS NOT NULL AND to_regclass(:letters) IS NOT NULL
