-- Payload protection (outboxer.payload_admin): claim-check references and key rotation.
-- These run on a connection of their own, outside the relay; tokens in braces are names.

-- name: referenced
-- Which of these claim-check objects (a JSON array) some row, whatever its status, still
-- refers to: the orphan sweep deletes only the others. Through claim_check_idx (migration
-- 0007), whose condition the first line of the WHERE clause repeats word for word.
SELECT json_extract(headers, '$."outboxer-claim-check"') AS name
FROM {outbox}
WHERE json_extract(headers, '$."outboxer-claim-check"') IS NOT NULL
  AND json_extract(headers, '$."outboxer-claim-check"') IN (SELECT value FROM json_each(:names))

-- name: rotation_batch
-- The next rows to re-encrypt: unfinished, not claimed by a relay (PROCESSING), encrypted
-- under another key than the current one; in seq order after the previous batch.
SELECT seq, id, destination, topic, key, payload, content_type, headers
FROM {outbox}
WHERE status IN ('PENDING', 'FAILED')
  AND seq > :after
  AND json_extract(headers, '$."outboxer-key-id"') <> :current
ORDER BY seq
LIMIT :batch

-- name: rotation_update
-- Invariant: a row is rewritten only while it is unfinished, unclaimed and still under the
-- key it was read under (the batch runs in BEGIN IMMEDIATE: no relay writes in between).
UPDATE {outbox}
SET payload = :payload, content_type = :content_type, headers = :headers
WHERE seq = :seq
  AND status IN ('PENDING', 'FAILED')
  AND json_extract(headers, '$."outboxer-key-id"') = :old_key_id
