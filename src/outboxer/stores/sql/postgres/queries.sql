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
-- With :lock_keys false it takes none: the transaction holds table_lock instead.
WITH key_locks AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(ids.lock_id)
    FROM (SELECT DISTINCT hashtextextended('outboxer-key:' || k.key, 0) AS lock_id
          FROM unnest(CAST(:keys AS text[])) AS k(key)
          WHERE k.key IS NOT NULL AND CAST(:lock_keys AS boolean)) AS ids
    ORDER BY ids.lock_id)
INSERT INTO {outbox} (id, destination, topic, key, payload, content_type, headers)
SELECT m.id, m.destination, m.topic, m.key, m.payload, m.content_type, CAST(m.headers AS jsonb)
FROM unnest(CAST(:ids AS uuid[]), CAST(:destinations AS text[]), CAST(:topics AS text[]),
            CAST(:keys AS text[]), CAST(:payloads AS bytea[]), CAST(:content_types AS text[]),
            CAST(:headers AS text[]))
     WITH ORDINALITY AS m(id, destination, topic, key, payload, content_type, headers, position)
WHERE (SELECT count(*) FROM key_locks) >= 0
ORDER BY m.position

-- name: table_lock
-- In place of the key locks of a write with more keys than Outbox.max_key_locks: one
-- advisory lock per key would fill the cluster's shared lock table (a few thousand
-- entries by default; once it is full, every session's next lock fails, not only this
-- one's). SHARE ROW EXCLUSIVE conflicts with the ROW EXCLUSIVE lock every INSERT, claim,
-- settle and DELETE of the table takes, and with itself. Invariant: once it is granted,
-- every other transaction that wrote a row here has committed or rolled back, and none
-- writes one until this one ends, so this transaction's rows take their seqs after every
-- row committed before it and before every row committed after it: for every key, seq
-- order is commit order, as the key locks would keep it. The price: writers of any key,
-- and the relays' claims and settles, wait for this transaction's commit.
LOCK TABLE {outbox} IN SHARE ROW EXCLUSIVE MODE

-- name: destination_lock
-- Operators' changes (requeue) take the destination lock shared, like a settle: a claim
-- never sees their rows half-changed. See migration 0004 for the lock's reasons.
SELECT pg_advisory_xact_lock_shared(CAST(:lock_key AS bigint))

-- name: claim
-- Expired leases with their attempts used up -> ABANDONED; else the earliest expired lease
-- that heads its key -> PROCESSING alone (if :recover); else due PENDING | FAILED ->
-- PROCESSING, within :max_bytes of payload (plus one row); all under this claim's new
-- lease. One call, one round trip; the SQL and its invariants are in migrations 0006, 0010
-- (the byte budget), 0013 and 0014 (the lock order: it waits for its destination lock
-- only, taken first, and locks every row SKIP LOCKED, so it is never in a lock cycle).
-- A deadlock all the same (someone else's session) is tried again by the store
-- (postgres.py: _deadlock_retried): one statement, rolled back whole.
SELECT seq, id, destination, topic, key, payload, content_type, headers, attempts,
       created_at, taken, last_error
FROM {schema}.{table_raw}_claim(:destination, :relay_id, CAST(:lease AS uuid), :limit,
                                CAST(:lock_seconds AS float8), :abandoned_blocks,
                                :max_attempts, :recover, CAST(:lock_key AS bigint),
                                CAST(:max_bytes AS bigint))

-- name: settle
-- PROCESSING -> PUBLISHED | FAILED | ABANDONED | PENDING (released), by the holder of the
-- rows' lease, in one transaction; the SQL and its invariants are in migration 0006.
-- Lock order: the shared destination lock first, then only rows in flight under this
-- lease, which nothing of outboxer's locks meanwhile: claims wait for the lock, operators'
-- commands change other statuses, other settles other leases, retention SKIPs LOCKED, and
-- the relay stops the batch's renewals before it settles. A session of someone else's that
-- locks these rows in another order can deadlock with it: the store tries it again
-- (postgres.py: _deadlock_retried), as nothing outside the database happens inside it.
SELECT n_published, n_failed, n_released
FROM {schema}.{table_raw}_settle(:destination, :relay_id, CAST(:lease AS uuid),
                                 CAST(:lock_key AS bigint), :max_attempts,
                                 CAST(:published AS bigint[]), CAST(:failed AS bigint[]),
                                 CAST(:errors AS text[]), CAST(:delays AS float8[]),
                                 CAST(:permanent AS boolean[]), CAST(:released AS bigint[]))

-- name: renew
-- PROCESSING under this lease -> locked until :lock_seconds from now, one statement for the
-- batch, durably; the SQL and its invariants are in migration 0006. No destination lock:
-- it may wait for a row a claim locked, never the reverse (migration 0014), so no cycle;
-- a deadlock with someone else's session is tried again, as a settle's.
SELECT n_renewed
FROM {schema}.{table_raw}_renew(:destination, :relay_id, CAST(:lease AS uuid),
                                CAST(:seqs AS bigint[]), CAST(:lock_seconds AS float8))

-- name: expire_unanswered_recovery
-- PROCESSING, taken over from an expired lease by a claim that never answered -> still
-- PROCESSING, its lease expired now, so the next claim recovers it alone (step 2 of the
-- claim, another attempt counted). Runs before release_unanswered, in its transaction.
-- Invariants:
--  * a row recovered alone stays alone: released, it would be FAILED and claimed in a batch
--    with others, and if it is what kills its relay they would die with it again. A claim
--    that recovered a row took that row only, attempts counted (> 0); one that took a single
--    FAILED row looks the same and is recovered alone too: slower, never unsafe;
--  * only claims allowed to recover are passed here, and only rows still under their lease;
--  * lease cleared: release_unanswered no longer matches the row, nor does any settle or
--    renewal (nobody holds it); locked_by still names the relay, for last_error.
UPDATE {outbox} AS t
SET locked_until = now() - interval '1 millisecond', lease = NULL
WHERE t.destination = :destination
  AND t.status = 'PROCESSING'
  AND t.lease = ANY(CAST(:leases AS uuid[]))
  AND t.locked_by = :relay_id
  AND t.attempts > 0
  AND NOT EXISTS (SELECT 1 FROM {outbox} AS o
                  WHERE o.destination = t.destination AND o.status = 'PROCESSING'
                    AND o.lease = t.lease AND o.seq <> t.seq)

-- name: release_unanswered
-- PROCESSING under a lease whose claim never answered (its connection broke; it may have
-- committed) -> claimable again, due now, no attempt counted: the relay never got these
-- rows, so never published them. One statement, in one transaction with destination_lock
-- and expire_unanswered_recovery. Invariants:
--  * only rows still under one of those leases (lease and locked_by, as in settle): rows
--    taken over since, or settled, are left alone; none if the claim never committed;
--  * in a transaction that took the shared destination lock first (destination_lock), as
--    a settle: a claim never sees them half-changed, and a claim still waiting for the
--    exclusive lock (its client gone) is queued ahead of it, so this statement, whose
--    snapshot is taken once the lock is held, sees that claim's rows;
--  * a claim's rows go back all together: it took each key's rows in seq order with every
--    unfinished row before them, so no PENDING row of a key comes before one in flight.
--    A row with attempts made goes back FAILED, due now, as a settle's release does.
UPDATE {outbox}
SET status = CASE WHEN attempts > 0 THEN 'FAILED' ELSE 'PENDING' END,
    next_attempt_at = now(), locked_by = NULL, locked_until = NULL, lease = NULL,
    updated_at = now()
WHERE destination = :destination
  AND status = 'PROCESSING'
  AND lease = ANY(CAST(:leases AS uuid[]))
  AND locked_by = :relay_id

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
-- ABANDONED | FAILED -> PENDING, due now, attempts reset: an operator's decision. :statuses
-- narrows it; the status test is repeated so that no caller's list requeues another
-- status: a PROCESSING row made PENDING would be published by a second relay while its
-- holder still publishes it, a PUBLISHED one would be sent again.
-- A row with a later row of its key in flight stays as it is: see admin.sql,
-- requeue_matching (the shared destination locks are the caller's, as there).
UPDATE {outbox} AS o
SET status = 'PENDING', attempts = 0, next_attempt_at = now(), updated_at = now()
WHERE destination = ANY(CAST(:destinations AS text[]))
  AND status = ANY(CAST(:statuses AS text[]))
  AND status IN ('ABANDONED', 'FAILED')
  AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
  AND NOT (o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} AS f
        WHERE f.destination = o.destination AND f.key = o.key
          AND f.status = 'PROCESSING' AND f.seq > o.seq))

-- name: counts
-- Every row, counted exactly: a pass over the whole table. Only for a small table (see
-- status_stats); a big one is counted by counts_tally and estimated.
SELECT destination, status, count(*) AS count,
       count(*) FILTER (WHERE attempts > 0) AS retried,
       EXTRACT(EPOCH FROM now() - min(created_at)) AS oldest_age
FROM {outbox}
GROUP BY destination, status

-- name: counts_tally
-- Exact counts of every row but the PUBLISHED ones of a first attempt: the unfinished and
-- ABANDONED rows and the PUBLISHED ones that were retried, with the oldest created_at.
-- An index-only scan of status_idx, whose condition this WHERE clause repeats (migration
-- 0008): its cost follows the backlog, not the published history.
SELECT destination, status, count(*) AS count,
       count(*) FILTER (WHERE attempts > 0) AS retried,
       EXTRACT(EPOCH FROM now() - min(created_at)) AS oldest_age
FROM {outbox}
WHERE status <> 'PUBLISHED' OR attempts > 0
GROUP BY destination, status

-- name: status_stats
-- What the planner knows of the table, for the estimate of its PUBLISHED rows: the rows
-- and pages when VACUUM or ANALYZE last counted them (reltuples is -1 before either ran),
-- the pages now, and ANALYZE's share of each common destination among all rows. Catalog
-- reads only: no lock beyond what a plan takes, nothing read from the outbox itself.
SELECT c.reltuples, c.relpages,
       pg_relation_size(c.oid) / CAST(current_setting('block_size') AS integer) AS pages,
       s.null_frac, s.n_distinct,
       CAST(CAST(s.most_common_vals AS text) AS text[]) AS destinations,
       s.most_common_freqs AS shares
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_stats AS s
       ON s.schemaname = n.nspname AND s.tablename = c.relname
      AND s.attname = 'destination' AND NOT s.inherited
WHERE c.oid = CAST('{outbox}' AS regclass)

-- name: status_stats_partitioned
-- status_stats for the partitioned layout, whose parent has no rows, pages or statistics
-- of its own (autovacuum analyzes the partitions, never the parent): the same columns,
-- summed over the partitions. reltuples is each analyzed partition's estimate now (rows
-- per page at its last count times its pages now; one never counted has no row yet, or
-- its share is unknown: NULL, as status_stats' -1, makes status count exactly), relpages
-- equals pages, and each destination's share is its rows over all partitions (ANALYZE's
-- share in each partition times the partition's rows).
WITH parts AS (
    SELECT c.oid,
           pg_relation_size(c.oid) / CAST(current_setting('block_size') AS integer) AS pages,
           CASE WHEN pg_relation_size(c.oid) = 0 THEN 0
                WHEN c.reltuples < 0 OR c.relpages = 0 THEN NULL
                ELSE c.reltuples * (pg_relation_size(c.oid)
                                    / CAST(current_setting('block_size') AS integer))
                     / c.relpages END AS rows,
           n.nspname, c.relname
    FROM pg_inherits AS i
    JOIN pg_class AS c ON c.oid = i.inhrelid
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE i.inhparent = CAST('{outbox}' AS regclass)
),
total AS (
    SELECT CASE WHEN bool_and(rows IS NOT NULL) THEN sum(rows) END AS rows,
           sum(pages) AS pages
    FROM parts
),
shares AS (
    SELECT d.destination, sum(d.share * p.rows) AS rows
    FROM parts AS p
    JOIN pg_stats AS s
      ON s.schemaname = p.nspname AND s.tablename = p.relname
     AND s.attname = 'destination' AND NOT s.inherited
    CROSS JOIN LATERAL unnest(CAST(CAST(s.most_common_vals AS text) AS text[]),
                              s.most_common_freqs) AS d(destination, share)
    WHERE p.rows > 0
    GROUP BY d.destination
)
SELECT CAST(coalesce(t.rows, -1) AS float8) AS reltuples,
       CAST(t.pages AS integer) AS relpages,
       CAST(t.pages AS bigint) AS pages,
       CAST(0 AS float4) AS null_frac,
       CAST(count(sh.destination) AS float4) AS n_distinct,
       CASE WHEN count(sh.destination) > 0 THEN array_agg(sh.destination) END AS destinations,
       CASE WHEN count(sh.destination) > 0
            THEN array_agg(CAST(sh.rows / nullif(t.rows, 0) AS float4)) END AS shares
FROM total AS t
LEFT JOIN shares AS sh ON true
GROUP BY t.rows, t.pages

-- name: list
-- The newest changes first (updated_at, then seq: a stable order), at most :limit rows.
-- One branch per status, each a walk backwards over an index that stops after :limit
-- rows (status_idx; finished_idx for PUBLISHED, whose rows status_idx mostly lacks), and
-- a merge of the branches; a branch whose status is not asked for does not run. A single
-- `status = ANY(...) ORDER BY updated_at` would sort every row of the statuses asked for.
SELECT *
FROM (
    (SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
            created_at, updated_at, next_attempt_at, published_at
     FROM {outbox}
     WHERE status = 'PENDING' AND (status <> 'PUBLISHED' OR attempts > 0)
       AND 'PENDING' = ANY(CAST(:statuses AS text[]))
     ORDER BY updated_at DESC, seq DESC LIMIT :limit)
    UNION ALL
    (SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
            created_at, updated_at, next_attempt_at, published_at
     FROM {outbox}
     WHERE status = 'PROCESSING' AND (status <> 'PUBLISHED' OR attempts > 0)
       AND 'PROCESSING' = ANY(CAST(:statuses AS text[]))
     ORDER BY updated_at DESC, seq DESC LIMIT :limit)
    UNION ALL
    (SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
            created_at, updated_at, next_attempt_at, published_at
     FROM {outbox}
     WHERE status = 'FAILED' AND (status <> 'PUBLISHED' OR attempts > 0)
       AND 'FAILED' = ANY(CAST(:statuses AS text[]))
     ORDER BY updated_at DESC, seq DESC LIMIT :limit)
    UNION ALL
    (SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
            created_at, updated_at, next_attempt_at, published_at
     FROM {outbox}
     WHERE status = 'ABANDONED' AND (status <> 'PUBLISHED' OR attempts > 0)
       AND 'ABANDONED' = ANY(CAST(:statuses AS text[]))
     ORDER BY updated_at DESC, seq DESC LIMIT :limit)
    UNION ALL
    (SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
            created_at, updated_at, next_attempt_at, published_at
     FROM {outbox}
     WHERE status = 'PUBLISHED'
       AND 'PUBLISHED' = ANY(CAST(:statuses AS text[]))
     ORDER BY updated_at DESC, seq DESC LIMIT :limit)
) AS newest
ORDER BY updated_at DESC, seq DESC
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
-- Inbox entries older than the retention -> deleted, :limit a statement. SKIP LOCKED, as
-- the outbox's cleanup: an entry a consumer's or an operator's open transaction holds (one
-- it deletes to have a message applied again, or locks) is left for a later round instead
-- of holding this statement, and the relay's connection, until that transaction ends.
DELETE FROM {inbox}
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {inbox}
    WHERE received_at < now() - make_interval(secs => CAST(:retention AS float8))
    ORDER BY received_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED))


-- name: inbox_suspects_cleanup
-- Suspect rows (consumer.sql, suspect_attempt) whose latest attempt was recorded longer
-- ago than the inbox's retention (first_seen: each attempt sets it to now) -> deleted,
-- :limit a statement. Such a row belongs to a message not delivered again for a whole
-- retention (its consumer died under it, then the broker dropped it or an operator purged
-- it): nothing else ever deletes it. A message that keeps coming back keeps its row, however
-- slowly its deaths come, as long as no two attempts are a retention apart. SKIP LOCKED:
-- a row a consumer's suspect_attempt upsert or applying transaction holds is left for a
-- later round rather than holding this statement, and the relay's connection, meanwhile.
DELETE FROM {inbox_suspects}
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {inbox_suspects}
    WHERE first_seen < now() - make_interval(secs => CAST(:retention AS float8))
    ORDER BY first_seen
    LIMIT :limit
    FOR UPDATE SKIP LOCKED))

-- name: register_listener
-- This relay is idle and listening until :seconds from now: writers NOTIFY meanwhile.
INSERT INTO {listeners} (relay, until)
VALUES (:relay, now() + make_interval(secs => CAST(:seconds AS float8)))
ON CONFLICT (relay) DO UPDATE SET until = EXCLUDED.until

-- name: unregister_listener
DELETE FROM {listeners} WHERE relay = :relay OR until < now() - interval '1 hour'

-- name: due_destinations
-- Which of :destinations have a row a claim could take now, read only: a due PENDING |
-- FAILED row, or a lease that expired. A superset of what the claim takes (a key's order,
-- held back rows and max_attempts are the claim's to judge): a destination left out has
-- nothing a claim would take at this statement's snapshot. Asked once for the loops of
-- every quiet destination woken together (stores.wakeups), each an index probe through
-- ready_idx of that destination's unfinished rows.
SELECT d.destination
FROM unnest(CAST(:destinations AS text[])) AS d(destination)
WHERE EXISTS (
    SELECT 1 FROM {outbox} AS o
    WHERE o.destination = d.destination
      AND o.status IN ('PENDING', 'FAILED', 'PROCESSING')
      AND CASE o.status WHEN 'PROCESSING' THEN o.locked_until < now()
                        ELSE o.next_attempt_at <= now() END)
