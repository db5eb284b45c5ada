-- PostgreSQL queries, one named block each. Parameters are :name; tokens in braces are
-- replaced with quoted names from the settings.

-- name: insert
-- -> PENDING. Runs on the caller's connection, inside the caller's transaction.
-- Per-key order = commit order: before the row takes its seq, the transaction takes a
-- lock on its key, held until it commits or rolls back. A second writer of the same key
-- waits there, so it takes a larger seq only after the first one's row is visible, and a
-- relay can never publish a key's later row while an earlier one is still uncommitted.
-- Writers of different keys, and keyless messages, never wait for each other.
INSERT INTO {outbox} (id, destination, topic, key, payload, content_type, headers)
SELECT CAST(:id AS uuid), :destination, :topic, m.key, :payload, :content_type,
       CAST(:headers AS jsonb)
FROM (SELECT CAST(:key AS text) AS key) AS m
LEFT JOIN LATERAL (
    SELECT pg_advisory_xact_lock(hashtextextended('outboxer-key:' || m.key, 0))
    WHERE m.key IS NOT NULL) AS key_lock ON true

-- name: insert_many
-- -> PENDING for every row, in the caller's order (unnest keeps it), each key locked
-- before its row takes a seq, as in insert.
INSERT INTO {outbox} (id, destination, topic, key, payload, content_type, headers)
SELECT m.id, m.destination, m.topic, m.key, m.payload, m.content_type, CAST(m.headers AS jsonb)
FROM unnest(CAST(:ids AS uuid[]), CAST(:destinations AS text[]), CAST(:topics AS text[]),
            CAST(:keys AS text[]), CAST(:payloads AS bytea[]), CAST(:content_types AS text[]),
            CAST(:headers AS text[]))
     WITH ORDINALITY AS m(id, destination, topic, key, payload, content_type, headers, position)
LEFT JOIN LATERAL (
    SELECT pg_advisory_xact_lock(hashtextextended('outboxer-key:' || m.key, 0))
    WHERE m.key IS NOT NULL) AS key_lock ON true
ORDER BY m.position

-- name: claim_lock
-- Claims of one destination run one at a time (a transaction-scoped lock, held for one
-- short statement). Settles take the same lock shared. Together this means a claim never
-- sees a row half-way through another relay's claim or settle, which SKIP LOCKED alone
-- cannot promise: it would skip such a row and could claim the row behind it, same key.
SELECT pg_advisory_xact_lock(CAST(:lock_key AS bigint))

-- name: settle_lock
SELECT pg_advisory_xact_lock_shared(CAST(:lock_key AS bigint))

-- name: claim
-- PENDING | FAILED (due) | PROCESSING (lock expired) -> PROCESSING, locked by this relay.
-- Invariants kept by the WHERE clause:
--  * a row is due: its next attempt has come, or its relay's lock expired (that relay died);
--  * a keyed row is claimed only when no earlier row of its key blocks it: in flight
--    elsewhere, backing off, or abandoned when abandoned rows block. Earlier rows that are
--    due themselves come first in seq order, so they are in this same batch, ahead of it;
--  * no uncommitted row of the key can have a smaller seq than a committed one: the insert
--    holds the key's lock until commit before it takes its seq (see insert). So a row
--    committed late can never be overtaken: it sorts after everything visible here.
WITH due AS (
    SELECT o.ctid
    FROM {outbox} AS o
    WHERE o.destination = :destination
      AND o.status IN ('PENDING', 'FAILED', 'PROCESSING')
      AND CASE o.status WHEN 'PROCESSING' THEN o.locked_until < now()
                        ELSE o.next_attempt_at <= now() END
      AND (o.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {outbox} AS b
            WHERE b.destination = o.destination
              AND b.key = o.key
              AND b.status IN ('PROCESSING', 'FAILED', 'ABANDONED')
              AND b.seq < o.seq
              AND CASE b.status WHEN 'PROCESSING' THEN b.locked_until >= now()
                                WHEN 'FAILED' THEN b.next_attempt_at > now()
                                ELSE CAST(:abandoned_blocks AS boolean) END))
    ORDER BY o.seq
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
UPDATE {outbox} AS t
SET status = 'PROCESSING',
    locked_by = :relay_id,
    locked_until = now() + make_interval(secs => CAST(:lock_seconds AS float8)),
    -- Taking over an expired lock: the previous attempt died with its relay, so it counts.
    attempts = t.attempts + CASE WHEN t.status = 'PROCESSING' THEN 1 ELSE 0 END,
    last_error = CASE WHEN t.status = 'PROCESSING'
                      THEN 'lock expired: relay ' || coalesce(t.locked_by, '?') || ' died or stalled'
                      ELSE t.last_error END,
    updated_at = now()
FROM due
WHERE t.ctid = due.ctid
RETURNING t.seq, t.id, t.destination, t.topic, t.key, t.payload, t.content_type,
          CAST(t.headers AS text) AS headers, t.attempts, t.created_at

-- name: settle_published
-- PROCESSING -> PUBLISHED, only by the relay holding the lock: a relay whose expired lock
-- was taken over changes nothing (its copy was a duplicate; the new owner decides).
UPDATE {outbox}
SET status = 'PUBLISHED', published_at = now(), updated_at = now(),
    locked_by = NULL, locked_until = NULL
WHERE destination = :destination AND seq = ANY(CAST(:seqs AS bigint[]))
  AND status = 'PROCESSING' AND locked_by = :relay_id

-- name: settle_failed
-- PROCESSING -> FAILED (attempts + 1, due again after its backoff), or -> ABANDONED when the
-- failure is permanent or the attempts are used up. Only by the relay holding the lock.
UPDATE {outbox} AS t
SET attempts = t.attempts + 1,
    last_error = f.error,
    status = CASE WHEN f.permanent OR t.attempts + 1 >= :max_attempts
                  THEN 'ABANDONED' ELSE 'FAILED' END,
    next_attempt_at = now() + make_interval(secs => f.delay),
    locked_by = NULL, locked_until = NULL, updated_at = now()
FROM unnest(CAST(:seqs AS bigint[]), CAST(:errors AS text[]), CAST(:delays AS float8[]),
            CAST(:permanent AS boolean[])) AS f(seq, error, delay, permanent)
WHERE t.destination = :destination AND t.seq = f.seq
  AND t.status = 'PROCESSING' AND t.locked_by = :relay_id

-- name: release
-- PROCESSING -> claimable again without counting an attempt (never tried: shutdown, or an
-- earlier message of its key failed). Only by the relay holding the lock.
UPDATE {outbox}
SET status = CASE WHEN attempts > 0 THEN 'FAILED' ELSE 'PENDING' END,
    next_attempt_at = now(), locked_by = NULL, locked_until = NULL, updated_at = now()
WHERE destination = :destination AND seq = ANY(CAST(:seqs AS bigint[]))
  AND status = 'PROCESSING' AND locked_by = :relay_id

-- name: cleanup
-- PUBLISHED | ABANDONED -> deleted once older than the retention; at most :limit rows a
-- statement, so no statement runs long or holds many locks; SKIP LOCKED passes over rows
-- an operator is changing.
DELETE FROM {outbox}
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {outbox}
    WHERE status = :status
      AND updated_at < now() - make_interval(secs => CAST(:retention AS float8))
    ORDER BY updated_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED))

-- name: requeue
-- ABANDONED | FAILED -> PENDING, due now, attempts reset: an operator's decision.
UPDATE {outbox}
SET status = 'PENDING', attempts = 0, next_attempt_at = now(), updated_at = now()
WHERE destination = ANY(CAST(:destinations AS text[]))
  AND status = ANY(CAST(:statuses AS text[]))
  AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))

-- name: counts
SELECT destination, status, count(*) AS count,
       count(*) FILTER (WHERE attempts > 0) AS retried,
       EXTRACT(EPOCH FROM now() - min(created_at)) AS oldest_age
FROM {outbox}
GROUP BY destination, status

-- name: list
SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
       created_at, updated_at, next_attempt_at, published_at
FROM {outbox}
WHERE status = ANY(CAST(:statuses AS text[]))
ORDER BY seq
LIMIT :limit

-- name: oldest_transaction
-- Age of the oldest open transaction that wrote something (seconds): a writer holding a
-- key's lock that long holds back that key's later messages, so status shows it.
SELECT coalesce(EXTRACT(EPOCH FROM now() - min(xact_start)), 0) AS age
FROM pg_stat_activity
WHERE backend_xid IS NOT NULL AND datname = current_database()

-- name: inbox_claim
-- First delivery of (consumer, message_id) -> recorded (1 row); any later one -> nothing
-- (0 rows). In the consumer's transaction: a concurrent delivery of the same message waits
-- on the primary key until this transaction ends, then finds the row; if this transaction
-- rolls back, the record goes with it and the next delivery applies the message.
INSERT INTO {inbox} (consumer, message_id)
VALUES (:consumer, CAST(:message_id AS uuid))
ON CONFLICT DO NOTHING

-- name: inbox_cleanup
-- Inbox entries older than the retention -> deleted, :limit a statement.
DELETE FROM {inbox}
WHERE ctid IN (
    SELECT ctid FROM {inbox}
    WHERE received_at < now() - make_interval(secs => CAST(:retention AS float8))
    ORDER BY received_at
    LIMIT :limit)

-- name: register_listener
-- This relay is idle and listening until :seconds from now: writers NOTIFY meanwhile.
INSERT INTO {listeners} (relay, until)
VALUES (:relay, now() + make_interval(secs => CAST(:seconds AS float8)))
ON CONFLICT (relay) DO UPDATE SET until = EXCLUDED.until

-- name: unregister_listener
DELETE FROM {listeners} WHERE relay = :relay OR until < now() - interval '1 hour'
