-- The consumer runner's SQL (outboxer.consumer_db, outboxer.consume_cli): the inbox claim
-- of a whole batch, and the dead letters. Each block runs on the consumer's own connection,
-- in its transaction; a state change is one statement.

-- name: inbox_claim_many
-- A batch's first deliveries -> recorded, and returned; those the inbox already had (applied
-- earlier) -> not returned. One round trip for the batch instead of one per message. The ids
-- come sorted, so two consumers claiming the same ids lock inbox rows in one order (no
-- deadlock); a concurrent claim of the same id waits for this transaction, as inbox_claim.
INSERT INTO {inbox} (consumer, message_id)
SELECT :consumer, id FROM unnest(CAST(:message_ids AS uuid[])) AS id
ON CONFLICT DO NOTHING
RETURNING message_id, txid_current_if_assigned() AS xid

-- name: transaction_id
-- The batch transaction's id, read once just before its commit: the one inbox_claim_many
-- returned unless a handler ran COMMIT or ROLLBACK and wrote again in a transaction the
-- driver began anew (psycopg does at once, unseen by its transaction status). Then the
-- batch is no longer one transaction: it must not commit as if it were.
SELECT txid_current_if_assigned() AS xid

-- name: transaction_committed
-- After a failed batch's rollback: whether its transaction (inbox_claim_many's) committed
-- all the same, by a handler's own COMMIT, taking the claims of the whole batch with it.
SELECT txid_status(CAST(:xid AS bigint)) = 'committed' AS committed

-- name: inbox_release_many
-- Claims of a batch whose handlers never ran -> gone, in a transaction of their own after the
-- batch's. Only when a handler ended the batch's transaction itself (a raw COMMIT): that
-- committed the claims inbox_claim_many made for the batch's later messages, which would
-- then be skipped as duplicates, never applied. Their handlers did not run, so the claims
-- stand for nothing: deleting them leaves inbox row <=> message applied true again. When
-- which handler committed is not known (transaction_id moved, or transaction_committed
-- after a failure), the claims of all but the batch's first handled message: a message
-- applied twice rather than one never applied.
DELETE FROM {inbox}
WHERE consumer = :consumer AND message_id = ANY(CAST(:message_ids AS uuid[]))

-- name: insert
-- A message whose handler failed max_attempts times (or that cannot be read, or that is held
-- back behind an earlier dead letter of its key) -> recorded once per consumer: a redelivery
-- dead-lettered again changes nothing.
INSERT INTO {dead_letters}
    (consumer, message_id, topic, key, headers, content_type, payload, created_at, error,
     attempts, held)
VALUES (:consumer, CAST(:message_id AS uuid), :topic, :key, CAST(:headers AS jsonb),
        :content_type, :payload, :created_at, :error, :attempts, :held)
ON CONFLICT (consumer, message_id) DO NOTHING

-- name: key_blocked
-- Whether the key has a dead letter of this consumer (abandoned_blocks_key: its later
-- messages are held back behind it). Runs in the transaction that would apply the message.
SELECT 1 AS blocked FROM {dead_letters} WHERE consumer = :consumer AND key = :key LIMIT 1

-- name: list
SELECT seq, consumer, message_id, topic, key, headers::text AS headers, content_type, payload,
       created_at, error, attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer OR CAST(:consumer AS text) IS NULL
ORDER BY seq
LIMIT :limit

-- name: page_after
-- A replay of a whole group walks it in pages of seq (keyset): memory bounded by the page.
SELECT seq, consumer, message_id, topic, key, headers::text AS headers, content_type, payload,
       created_at, error, attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer AND seq > :after
ORDER BY seq
LIMIT :limit

-- name: seq_of
-- A replay of chosen ids puts them in arrival order before it reads their rows.
SELECT seq FROM {dead_letters}
WHERE consumer = :consumer AND message_id = CAST(:message_id AS uuid)

-- name: one
SELECT seq, consumer, message_id, topic, key, headers::text AS headers, content_type, payload,
       created_at, error, attempts, held, failed_at
FROM {dead_letters}
WHERE consumer = :consumer AND message_id = CAST(:message_id AS uuid)

-- name: key_blocked_before
-- Whether an earlier dead letter of the key is still here (abandoned_blocks_key): one not
-- chosen for the replay, or one that failed again in it; a dead letter behind it stays.
SELECT 1 AS blocked FROM {dead_letters}
WHERE consumer = :consumer AND key = :key AND seq < :seq
LIMIT 1

-- name: delete
-- Replayed (in the transaction that applied it) or purged -> gone.
DELETE FROM {dead_letters} WHERE consumer = :consumer AND message_id = CAST(:message_id AS uuid)

-- name: purge_consumer
DELETE FROM {dead_letters} WHERE consumer = :consumer

-- name: failed_again
-- A replay that failed -> one more attempt, its error, no longer merely held back.
UPDATE {dead_letters}
SET attempts = attempts + 1, error = :error, held = false, failed_at = now()
WHERE consumer = :consumer AND message_id = CAST(:message_id AS uuid)

-- name: suspect_attempt
-- A redelivered message's attempt, recorded before its handler runs, in a transaction of
-- its own (committed before the handler can kill the process) -> the row exists while the
-- attempt runs. The first recorded attempt inserts deaths = 0; a later one finds the row an
-- earlier attempt left behind (it never ended: the process died under it) and adds one.
-- Returns the deaths before this attempt. One statement: two consumers of the group
-- recording at once serialise on the row, neither increment lost.
-- Each attempt sets first_seen to now, despite the column's name (kept: no migration for
-- it): first_seen is when the latest attempt was recorded. Invariant: a row no attempt
-- touched for a whole inbox_retention is a message not delivered again meanwhile, the only
-- kind the retention (queries.sql, inbox_suspects_cleanup) may delete. Kept from the first
-- attempt, a message whose deaths come further apart than the retention (a consumer
-- restarted less often) had its row deleted between two of them, its count started again,
-- and it was never dead-lettered.
INSERT INTO {inbox_suspects} AS suspect (consumer, message_id)
VALUES (:consumer, CAST(:message_id AS uuid))
ON CONFLICT (consumer, message_id) DO UPDATE
SET deaths = suspect.deaths + 1, first_seen = now()
RETURNING deaths

-- name: suspect_delete
-- The attempt ended -> the row is gone: in the transaction that applied the message (so
-- "row present" <=> "an attempt began and neither committed nor failed in-process"), or in
-- one of its own after a handler's exception (the in-process count takes over), after the
-- message became a dead letter, or when the consumer itself cut the attempt short (a
-- shutdown that cancelled or abandoned its handler: no death). A message never delivered
-- again leaves its row (harmless: nothing reads it but that message's next delivery, and
-- the retention deletes it).
DELETE FROM {inbox_suspects}
WHERE consumer = :consumer AND message_id = CAST(:message_id AS uuid)
