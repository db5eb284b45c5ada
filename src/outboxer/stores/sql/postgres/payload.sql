-- Payload protection (outboxer.payload_admin): claim-check references and key rotation.
-- These run on a connection of their own, outside the relay; tokens in braces are names.

-- name: referenced
-- Which of these claim-check objects some row, whatever its status, still refers to: the
-- orphan sweep deletes only the others. Through claim_check_idx (migration 0011), whose
-- condition the first line of the WHERE clause repeats.
SELECT headers->>'outboxer-claim-check' AS name
FROM {outbox}
WHERE headers ? 'outboxer-claim-check'
  AND headers->>'outboxer-claim-check' = ANY(:names)

-- name: oldest_transaction
-- When the oldest transaction still open in this database began (Unix time; NULL if none),
-- the sweep's own session aside: the sweep keeps every object written since, as that
-- transaction may yet commit a row that refers to one, however long it has been open.
-- Client sessions only (an autovacuum worker's long transaction enqueues nothing). A role
-- without pg_read_all_stats sees no xact_start of other roles' sessions: for those, the
-- grace period alone protects.
SELECT extract(epoch FROM min(xact_start))::float8 AS began
FROM pg_stat_activity
WHERE datname = current_database()
  AND backend_type = 'client backend'
  AND pid <> pg_backend_pid()
  AND xact_start IS NOT NULL

-- name: rotation_batch
-- The next rows to re-encrypt: unfinished, not claimed by a relay (PROCESSING), encrypted
-- under another key than the current one; in seq order after the previous batch.
SELECT seq, id, destination, topic, key, payload, content_type, headers::text AS headers
FROM {outbox}
WHERE status IN ('PENDING', 'FAILED')
  AND seq > :after
  AND headers->>'outboxer-key-id' <> :current
ORDER BY seq
LIMIT :batch

-- name: rotation_update
-- Invariant: a row is rewritten only while it is unfinished, unclaimed and still under the
-- key it was read under. A relay that claimed it meanwhile keeps the bytes it read (it may
-- be publishing them), and a concurrent rotation never overwrites a newer ciphertext.
UPDATE {outbox}
SET payload = :payload, content_type = :content_type, headers = CAST(:headers AS jsonb)
WHERE seq = :seq
  AND status IN ('PENDING', 'FAILED')
  AND headers->>'outboxer-key-id' = :old_key_id
