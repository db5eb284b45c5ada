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
-- -> PENDING for every row, in the caller's order (unnest keeps it). As in insert, every
-- key is locked before any row takes a seq: key_locks runs first (the WHERE's uncorrelated
-- subquery is an InitPlan, evaluated before the first row is produced). It takes the
-- locks in one global order (by lock id: a volatile function in a sorted SELECT list runs
-- after the sort), so two calls sharing keys never deadlock, whatever their callers' order.
WITH key_locks AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(ids.lock_id)
    FROM (SELECT DISTINCT hashtextextended('outboxer-key:' || k.key, 0) AS lock_id
          FROM unnest(CAST(:keys AS text[])) AS k(key) WHERE k.key IS NOT NULL) AS ids
    ORDER BY ids.lock_id)
INSERT INTO {outbox} (id, destination, topic, key, payload, content_type, headers)
SELECT m.id, m.destination, m.topic, m.key, m.payload, m.content_type, CAST(m.headers AS jsonb)
FROM unnest(CAST(:ids AS uuid[]), CAST(:destinations AS text[]), CAST(:topics AS text[]),
            CAST(:keys AS text[]), CAST(:payloads AS bytea[]), CAST(:content_types AS text[]),
            CAST(:headers AS text[]))
     WITH ORDINALITY AS m(id, destination, topic, key, payload, content_type, headers, position)
WHERE (SELECT count(*) FROM key_locks) >= 0
ORDER BY m.position

-- name: destination_lock
-- Operators' changes (requeue) take the destination lock shared, like a settle: a claim
-- never sees their rows half-changed. See migration 0004 for the lock's reasons.
SELECT pg_advisory_xact_lock_shared(CAST(:lock_key AS bigint))

-- name: claim
-- Expired leases with their attempts used up -> ABANDONED; else the earliest expired lease
-- that heads its key -> PROCESSING alone (if :recover); else due PENDING | FAILED ->
-- PROCESSING; all under this claim's new lease. One call, one round trip; the SQL and its
-- invariants are in migration 0006.
SELECT seq, id, destination, topic, key, payload, content_type, headers, attempts,
       created_at, taken, last_error
FROM {schema}.{table_raw}_claim(:destination, :relay_id, CAST(:lease AS uuid), :limit,
                                CAST(:lock_seconds AS float8), :abandoned_blocks,
                                :max_attempts, :recover, CAST(:lock_key AS bigint))

-- name: settle
-- PROCESSING -> PUBLISHED | FAILED | ABANDONED | PENDING (released), by the holder of the
-- rows' lease, in one transaction; the SQL and its invariants are in migration 0006.
SELECT n_published, n_failed, n_released
FROM {schema}.{table_raw}_settle(:destination, :relay_id, CAST(:lease AS uuid),
                                 CAST(:lock_key AS bigint), :max_attempts,
                                 CAST(:published AS bigint[]), CAST(:failed AS bigint[]),
                                 CAST(:errors AS text[]), CAST(:delays AS float8[]),
                                 CAST(:permanent AS boolean[]), CAST(:released AS bigint[]))

-- name: renew
-- PROCESSING under this lease -> locked until :lock_seconds from now, one statement for the
-- batch, durably; the SQL and its invariants are in migration 0006.
SELECT n_renewed
FROM {schema}.{table_raw}_renew(:destination, :relay_id, CAST(:lease AS uuid),
                                CAST(:seqs AS bigint[]), CAST(:lock_seconds AS float8))

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
