-- MySQL / MariaDB queries, one named block each. Parameters are :name; a list parameter
-- (:seqs, :statuses, ...) is written IN (:seqs) and expands to one placeholder per item,
-- so it is never empty. Tokens in braces are replaced with backquoted names. Comment lines
-- are not sent.
--
-- The relay's sessions run at READ COMMITTED: every statement reads what was committed
-- when it started, as on PostgreSQL. Times are UTC_TIMESTAMP(6), whatever the time zone.
-- MySQL evaluates an UPDATE's assignments left to right, each one seeing the columns the
-- earlier ones changed; so an assignment that reads a column always comes before the one
-- that changes it (and means the same under MariaDB's SIMULTANEOUS_ASSIGNMENT mode).
--
-- Keys compare byte for byte: `key` = x AND BINARY `key` = x. The columns' utf8mb4_bin
-- collation pads with spaces (PAD SPACE, on MariaDB and MySQL alike), so `key` = x alone
-- made 'a' and 'a ' one key: a row of one held back the other's. The plain equality
-- keeps the index seek; BINARY (no padding) drops the rows that only pad-equal x.
-- Destinations likewise, in every statement that chooses rows by destination rather than
-- by seq: 'orders ' cannot be enqueued any more (outboxer.message.destination_name_problem),
-- but an older version wrote such rows, and the relay of 'orders' claimed and published
-- them. Counts group by the bytes too. The destination lock ({destinations}) still takes
-- 'orders' and 'orders ' for one row: it only makes them wait for each other.

-- name: key_lock
-- The key lock. Runs on the caller's connection, in the caller's transaction, before the
-- insert of a keyed message (enqueue_many locks all its keys' slots in one statement).
-- Per-key order = commit order: AUTO_INCREMENT hands out seq before commit, so a row
-- committed late could be overtaken by a later one that committed first. Before the row
-- takes its seq, the transaction locks its key's slot row here (migration 0005: slot =
-- CRC32 of the key's UTF-8 bytes & 65535, computed by the writer, which sorts and dedups
-- the slots) and holds it until it commits or rolls back. A second writer of the same key
-- waits here, so it takes a larger seq only after the first one's row is visible, and the
-- relay can never publish a key's later row while an earlier one is uncommitted. Keyless
-- messages skip this statement; writers of other keys wait only when their keys share a
-- slot (one pair in 65536), which costs time, never order.
-- The slot rows always exist and are never inserted or deleted, so this takes record
-- locks only, in ascending slot order: two writers can never wait for each other in a
-- cycle. (A lock row per key, inserted on first use and deleted when unheld, deadlocked:
-- writers queued on a key whose row went away, by a rollback or a delete, were left
-- holding gap locks and each waited on the other's to insert it anew.)
SELECT slot FROM {key_slots} WHERE slot IN (:slots) ORDER BY slot FOR UPDATE

-- name: insert
-- -> PENDING, after key_lock when the message has a key. executemany makes one multi-row
-- INSERT of it, whose rows take increasing seqs in the caller's order.
INSERT INTO {outbox} (id, destination, topic, `key`, payload, content_type, headers)
VALUES (:id, :destination, :topic, :key, :payload, :content_type, :headers)

-- name: lock_destination
-- The destination lock, exclusive: claims (see migration 0001, {destinations}). Held until
-- the claim commits. No row yet (a destination's first lock): add_destination.
SELECT destination FROM {destinations} WHERE destination = :destination FOR UPDATE

-- name: lock_destination_shared
-- The destination lock, shared: settles and requeues. Held until they commit.
SELECT destination FROM {destinations} WHERE destination = :destination LOCK IN SHARE MODE

-- name: add_destination
-- A destination's first lock creates its row, locked exclusively until commit: inserted,
-- or found inserted by a concurrent first lock (ON DUPLICATE KEY UPDATE locks it too).
INSERT INTO {destinations} (destination) VALUES (:destination)
ON DUPLICATE KEY UPDATE destination = destination

-- name: claim_expired
-- A claim's first look, in its transaction, under the exclusive destination lock: rows in
-- flight whose lease expired (their relay died or stalled while publishing them), locked for
-- this transaction. The store abandons those whose attempts are used up (abandon_expired),
-- else takes the first one that heads its key, alone (claim_update), else claims as usual.
-- heads_key: no earlier row of its key is in flight or failed (due or not: it goes first),
-- nor abandoned when abandoned rows block; taken in seq order, a key's recovered rows keep
-- their order. No PENDING row of a key comes before a row in flight (see the PostgreSQL
-- migration 0006), so blocking_idx answers the probe. A row abandoned by this claim still
-- counts here: its key's next row heads the key from the next claim on. lease_idx serves
-- the range.
SELECT o.seq, o.id, o.destination, o.topic, o.`key`, o.payload, o.content_type, o.headers,
       o.attempts, o.status, o.created_at,
       (o.`key` IS NULL OR NOT EXISTS (
            SELECT 1 FROM {outbox} AS b
            WHERE b.destination = o.destination
              AND BINARY b.destination = BINARY o.destination
              AND b.blocker = 1
              AND b.`key` = o.`key`
              AND BINARY b.`key` = BINARY o.`key`
              AND b.seq < o.seq
              AND (b.status <> 'ABANDONED' OR :abandoned_blocks))) AS heads_key
FROM {outbox} AS o
WHERE o.destination = :destination
  AND BINARY o.destination = :destination
  AND o.locked_until < UTC_TIMESTAMP(6)
  AND o.status = 'PROCESSING'
ORDER BY o.seq
LIMIT :limit
FOR UPDATE SKIP LOCKED

-- name: abandon_expired
-- PROCESSING, lease expired, attempts used up -> ABANDONED: the attempt that died counts,
-- and with it max_attempts attempts were made (the store checked), so the row is given up
-- as a failed publish at its last attempt is, instead of being taken over for ever. The rest
-- of its key follows abandoned_blocks. Rows claim_expired locked, same transaction.
UPDATE {outbox}
SET last_error = CONCAT('abandoned after ', attempts + 1, ' attempts: relay ',
                        COALESCE(locked_by, '?'),
                        ' died or stalled while publishing this message (its lease expired)'),
    attempts = attempts + 1,
    status = 'ABANDONED',
    locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = UTC_TIMESTAMP(6)
WHERE seq IN (:seqs) AND destination = :destination AND status = 'PROCESSING'

-- name: release_behind_abandoned
-- PROCESSING, lease expired, behind a row of its key that abandon_expired just abandoned
-- (:after, its seq) -> FAILED, due now: the attempt that died counts, as a takeover's does
-- (claim_update; attempts and last_error read locked_by before it changes). The dead relay
-- held the key's rows in one batch; left in flight, such a row was never a head again
-- (the abandoned row blocks it when abandoned rows block), so it stayed PROCESSING for
-- good, and once an operator requeued the abandoned row (PENDING: no longer a blocker) it
-- was recovered, and published, before it. FAILED, it is claimed in seq order behind the
-- abandoned row, as a row the relay released when the abandoned row failed would be.
-- Same transaction, under the exclusive destination lock; blocking_idx serves the range.
-- A renewal by a stalled holder that lands first makes locked_until current: left alone.
-- Run only when abandoned rows block: otherwise such a row heads its key and is
-- recovered alone (step 2). A row this attempt would use up is left to the next
-- claim's abandon_expired (ABANDONED, not FAILED at max_attempts).
UPDATE {outbox}
SET attempts = attempts + 1,
    last_error = CONCAT('relay ', COALESCE(locked_by, '?'),
                        ' died or stalled while publishing this message (its lease expired)'),
    status = 'FAILED',
    next_attempt_at = UTC_TIMESTAMP(6),
    locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = UTC_TIMESTAMP(6)
WHERE destination = :destination
  AND BINARY destination = :destination
  AND blocker = 1
  AND `key` = :key
  AND BINARY `key` = :key
  AND seq > :after
  AND status = 'PROCESSING'
  AND attempts + 1 < :max_attempts
  AND locked_until < UTC_TIMESTAMP(6)

-- name: abandoned_before_expired
-- Per expired row in flight (its relay died or stalled), the first ABANDONED row of its key
-- before it, if any: release_behind_abandoned then releases the rows in flight behind it,
-- when abandoned rows block. Not only rows abandon_expired just abandoned: the key's first
-- row may have been recovered alone by an earlier claim and abandoned by its settle (a
-- permanent refusal), its batch-mates still under the dead lease; left in flight, they were
-- never a head again, requeue refused the abandoned row (a later row of its key in flight)
-- and purge refused them (PROCESSING): the key was stuck. lease_idx serves the outer range,
-- blocking_idx the probe. Same transaction, under the exclusive destination lock.
SELECT t.`key` AS `key`,
       (SELECT min(a.seq) FROM {outbox} AS a
        WHERE a.destination = t.destination
          AND BINARY a.destination = BINARY t.destination
          AND a.blocker = 1
          AND a.`key` = t.`key`
          AND BINARY a.`key` = BINARY t.`key`
          AND a.status = 'ABANDONED'
          AND a.seq < t.seq) AS after
FROM {outbox} AS t
WHERE t.destination = :destination
  AND BINARY t.destination = :destination
  AND t.locked_until < UTC_TIMESTAMP(6)
  AND t.status = 'PROCESSING'
  AND t.`key` IS NOT NULL

-- name: abandoned_rows
-- What abandon_expired recorded, for the relay's log.
SELECT seq, id, topic, `key`, attempts, last_error FROM {outbox} WHERE seq IN (:seqs)

-- name: claim
-- Due PENDING | FAILED rows: locked for this transaction, which holds the exclusive
-- destination lock and goes on with claim_update, then commits.
-- Invariants kept by the WHERE clause:
--  * a row is due: its next attempt has come. A row in flight is never taken here, even
--    once its lease expired: claim_expired takes such a row, alone;
--  * a keyed row is claimed only when no earlier row of its key blocks it: in flight (even
--    with its lease expired: it is recovered first), backing off, or abandoned when
--    abandoned rows block. Earlier rows that are due themselves come first in seq order,
--    so they are in this same batch, ahead of it;
--  * no uncommitted row of the key can have a smaller seq than a committed one: the writer
--    holds the key's lock until commit before it takes its seq (key_lock). So a row
--    committed late can never be overtaken: it sorts after everything visible here.
-- SKIP LOCKED passes over rows whose insert is not committed yet (the writer holds them):
-- they do not exist yet. Nothing else locks this destination's unfinished rows while the
-- destination lock is held, so it never skips a due row and lets its key's next row pass.
-- The NOT EXISTS subquery is a plain read of the latest commits (FOR UPDATE does not reach
-- into subqueries). ready_idx serves the scan in seq order; blocking_idx the probe.
-- The byte budget: the locked rows, in seq order, are returned while the payload bytes of
-- the rows before them stay under :max_bytes: at most :max_bytes plus one row, at least one
-- row (a larger payload goes alone), and a seq-order prefix, so no key's later row goes
-- without its earlier one. The rows past the cut stay locked until commit, unchanged. The
-- payloads are read (by primary key) for the rows returned only, as of the statement's
-- snapshot (READ COMMITTED): under the exclusive destination lock nothing else changes a
-- due row, and a row whose insert committed while the statement ran, locked but not seen,
-- is left for the next claim (claim_earlier then keeps its key's later rows behind it).
-- LENGTH reads a BLOB whole on InnoDB: the budget bounds what the relay holds, not what
-- the server reads (up to :limit payloads, one at a time, as before).
SELECT o.seq, o.id, o.destination, o.topic, o.`key`, o.payload, o.content_type, o.headers,
       o.attempts, o.status, o.created_at
FROM (SELECT w.seq, SUM(w.bytes) OVER (
                 ORDER BY w.seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS bytes_before
      FROM (
SELECT o.seq, LENGTH(o.payload) AS bytes
FROM {outbox} AS o
WHERE o.destination = :destination
  AND BINARY o.destination = :destination
  AND o.unfinished = 1
  AND o.status <> 'PROCESSING'
  AND o.next_attempt_at <= UTC_TIMESTAMP(6)
  AND (o.`key` IS NULL OR NOT EXISTS (
        SELECT 1 FROM {outbox} AS b
        WHERE b.destination = o.destination
          AND BINARY b.destination = BINARY o.destination
          AND b.blocker = 1
          AND b.`key` = o.`key`
          AND BINARY b.`key` = BINARY o.`key`
          AND b.seq < o.seq
          AND CASE b.status WHEN 'PROCESSING' THEN 1
                            WHEN 'FAILED' THEN b.next_attempt_at > UTC_TIMESTAMP(6)
                            ELSE :abandoned_blocks END))
ORDER BY o.seq
LIMIT :limit
FOR UPDATE SKIP LOCKED
      ) AS w) AS d
JOIN {outbox} AS o ON o.seq = d.seq
WHERE COALESCE(d.bytes_before, 0) < :max_bytes
ORDER BY o.seq

-- name: claim_earlier
-- Unfinished keyed rows before the claim's last row, as the latest commits show them: a
-- fresh read after claim. SKIP LOCKED also passes over a committed row another transaction
-- holds, and claim's NOT EXISTS reads a snapshot from its start, so a key's later row could
-- otherwise go ahead of an earlier one that was locked, or committed, while claim ran. The
-- store keeps a claimed row only if no row of its key outside the batch comes before it.
SELECT seq, `key` FROM {outbox}
WHERE destination = :destination AND BINARY destination = :destination
  AND unfinished = 1 AND seq < :last_seq AND `key` IS NOT NULL

-- name: claim_update
-- The rows claim (or claim_expired) locked -> PROCESSING under this claim's new lease,
-- locked by this relay until :lock_seconds from now; same transaction, so they cannot have
-- changed since. Taking over an expired lease: the attempt that died counts, and last_error
-- names the relay that held the row (attempts and last_error read status and locked_by
-- before those change). The caller checks that every row was updated.
UPDATE {outbox}
SET attempts = attempts + IF(status = 'PROCESSING', 1, 0),
    last_error = IF(status = 'PROCESSING',
                    CONCAT('relay ', COALESCE(locked_by, '?'),
                           ' died or stalled while publishing this message (its lease expired)'),
                    last_error),
    status = 'PROCESSING',
    locked_by = :relay_id,
    lease = :lease,
    locked_until = UTC_TIMESTAMP(6) + INTERVAL :lock_seconds SECOND,
    updated_at = UTC_TIMESTAMP(6)
WHERE seq IN (:seqs) AND destination = :destination
  AND status IN ('PENDING', 'FAILED', 'PROCESSING')

-- name: renew
-- PROCESSING under this lease -> locked until :lock_seconds from now: one statement for the
-- batch, while the relay still publishes it. Invariants:
--  * only the lease holder extends a row (lease, and locked_by against relays that write no
--    lease): a stale holder never takes back a row another claim holds. A holder whose
--    lease ran out but that nobody took over yet may extend it: nobody published it since;
--  * no destination lock: a renewal changes no status and lets no key's row overtake
--    another. A claim that reads the row before the renewal commits either skips it (the
--    renewal holds it) and claim_earlier then holds back its key, or locks it first and
--    changes the lease, which the renewal then no longer matches.
UPDATE {outbox}
SET locked_until = UTC_TIMESTAMP(6) + INTERVAL :lock_seconds SECOND
WHERE seq IN (:seqs) AND destination = :destination
  AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: settle_published
-- PROCESSING -> PUBLISHED, only by the holder of the rows' lease (lease, and locked_by
-- against relays that write no lease): a holder whose lease expired and was taken over
-- changes nothing (its copy was a duplicate; the new holder decides). Settles run in one
-- transaction under the shared destination lock. A settled row holds no lease.
UPDATE {outbox}
SET status = 'PUBLISHED', published_at = UTC_TIMESTAMP(6), updated_at = UTC_TIMESTAMP(6),
    locked_by = NULL, locked_until = NULL, lease = NULL
WHERE seq IN (:seqs) AND destination = :destination
  AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: settle_failed
-- PROCESSING -> FAILED (attempts + 1, due again after its backoff), or -> ABANDONED when the
-- failure is permanent or the attempts are used up. Only by the lease holder. One execution
-- per failed row (each has its own error and delay), in the settle's transaction; status
-- reads attempts before attempts changes. The error is storable already (bounded, valid
-- UTF-8: stores.base.storable_error).
UPDATE {outbox}
SET status = CASE WHEN :permanent OR attempts + 1 >= :max_attempts
                  THEN 'ABANDONED' ELSE 'FAILED' END,
    attempts = attempts + 1,
    last_error = :error,
    next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL :delay SECOND,
    locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = UTC_TIMESTAMP(6)
WHERE seq = :seq AND destination = :destination
  AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: release
-- PROCESSING -> claimable again without counting an attempt (not tried, or its lease ran
-- out mid-publish: shutdown, an earlier message of its key failed, the database
-- unreachable; or taken by a claim whose COMMIT got no answer, so never published: see
-- expire_unanswered_recovery). Only by the lease holder: rows taken over or settled since
-- are left alone, and none match if that claim never committed. A claim's rows go back
-- all together (it took each key's rows in seq order with every unfinished row before
-- them), in a transaction holding the shared destination lock, as a settle.
UPDATE {outbox}
SET status = IF(attempts > 0, 'FAILED', 'PENDING'),
    next_attempt_at = UTC_TIMESTAMP(6), locked_by = NULL, locked_until = NULL, lease = NULL,
    updated_at = UTC_TIMESTAMP(6)
WHERE seq IN (:seqs) AND destination = :destination
  AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: expire_unanswered_recovery
-- PROCESSING, taken over from an expired lease by a claim whose COMMIT got no answer ->
-- still PROCESSING, its lease expired now, so the next claim recovers it alone (claim_expired,
-- another attempt counted). In the transaction of the other rows' release, under the
-- shared destination lock. Invariants:
--  * a row recovered alone stays alone: released, it would be FAILED and claimed in a batch
--    with others, and if it is what kills its relay they would die with it again;
--  * only the row that claim recovered (:seqs, the one row it took), still under its lease
--    (lease and locked_by): a row taken over or settled since is left alone;
--  * lease cleared: no settle, renewal or release matches it any more; locked_by still
--    names the relay, for last_error.
UPDATE {outbox}
SET locked_until = UTC_TIMESTAMP(6) - INTERVAL 1000 MICROSECOND, lease = NULL
WHERE seq IN (:seqs) AND destination = :destination
  AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: cleanup_candidates
-- Retention, step 1: the seqs of at most :limit PUBLISHED | ABANDONED rows older than the
-- retention, oldest first, read through finished_idx without a lock (a consistent read).
-- Not one `DELETE … ORDER BY updated_at LIMIT`: on a small table InnoDB chose a full scan
-- for it and locked every row it read, so it waited for the rows a claim held and could
-- deadlock with the claim; a single-table DELETE takes no index hint.
SELECT seq FROM {outbox} FORCE INDEX (finished_idx)
WHERE status = :status
  AND updated_at < UTC_TIMESTAMP(6) - INTERVAL :retention SECOND
ORDER BY updated_at
LIMIT :limit

-- name: cleanup
-- Retention, step 2, in the same transaction: PUBLISHED | ABANDONED -> deleted, through the
-- primary key (the multi-table form, which takes the index hint), so it reads and locks
-- only the rows it deletes: through finished_idx InnoDB read on past them. Each row is
-- checked again: one a requeue made PENDING since step 1 stays. Relays never lock finished
-- rows; a requeue that is changing one makes this wait for it.
DELETE finished FROM {outbox} AS finished FORCE INDEX (PRIMARY)
WHERE finished.seq IN (:seqs)
  AND finished.status = :status
  AND finished.updated_at < UTC_TIMESTAMP(6) - INTERVAL :retention SECOND

-- name: requeue
-- ABANDONED | FAILED -> PENDING, due now, attempts reset: an operator's decision. Runs under
-- the shared destination lock of each destination. :all_ids, or only the rows in :ids.
-- :statuses narrows it; the status test is repeated so that no caller's list requeues a
-- PROCESSING row (a relay holds it) or a PUBLISHED one (sent again): see PostgreSQL's.
-- A row with a later row of its key in flight stays as it is: see admin.sql,
-- requeue_matching (and there for the derived table).
UPDATE {outbox}
LEFT JOIN (SELECT CAST(destination AS BINARY) AS flight_destination,
                  CAST(`key` AS BINARY) AS flight_key, MAX(seq) AS flight_last
           FROM {outbox}
           WHERE destination IN (:destinations) AND blocker = 1 AND status = 'PROCESSING'
             AND `key` IS NOT NULL
           GROUP BY CAST(destination AS BINARY), CAST(`key` AS BINARY)) AS in_flight
  ON in_flight.flight_destination = CAST(destination AS BINARY)
 AND in_flight.flight_key = CAST(`key` AS BINARY)
SET status = 'PENDING', attempts = 0, next_attempt_at = UTC_TIMESTAMP(6),
    updated_at = UTC_TIMESTAMP(6)
WHERE destination IN (:destinations)
  AND BINARY destination IN (:destinations)
  AND status IN (:statuses)
  AND status IN ('ABANDONED', 'FAILED')
  AND (:all_ids OR id IN (:ids))
  AND (in_flight.flight_last IS NULL OR in_flight.flight_last < seq)

-- name: counts
-- Every row, counted exactly: a pass over the whole table. Only for a small table (see
-- seq_range); a big one is counted by counts_tally and sample_published.
SELECT MIN(destination) AS destination, status, COUNT(*) AS count,
       SUM(attempts > 0) AS retried,
       TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) / 1000000 AS oldest_age
FROM {outbox}
GROUP BY CAST(destination AS BINARY), status

-- name: seq_range
-- The first and last seq: the two ends of the primary key. last - first + 1 bounds the
-- rows (counts reads them all when it is small) and spans sample_published's draw.
SELECT MIN(seq) AS first_seq, MAX(seq) AS last_seq FROM {outbox}

-- name: counts_tally
-- Exact counts of every row but the PUBLISHED ones of a first attempt: the unfinished and
-- ABANDONED rows and the PUBLISHED ones that were retried, with the oldest created_at.
-- Ranges of status_idx (status, attempts, destination, created_at), covered (migration
-- 0004): its cost follows the backlog, not the published history.
SELECT MIN(destination) AS destination, status, COUNT(*) AS count,
       SUM(attempts > 0) AS retried,
       TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) / 1000000 AS oldest_age
FROM {outbox} FORCE INDEX (status_idx)
WHERE status IN ('PENDING', 'PROCESSING', 'FAILED', 'ABANDONED')
   OR (status = 'PUBLISHED' AND attempts > 0)
GROUP BY CAST(destination AS BINARY), status

-- name: sample_published
-- The PUBLISHED rows of a first attempt among :seqs, seqs drawn at random between the first
-- and the last (stores.base.sample_seqs), per destination: primary-key lookups, one per
-- seq (forced: status_idx covers the columns too, and the optimizer may pick it and read
-- every PUBLISHED row). Their share of the draw estimates their share of the range (a
-- deleted row's seq is drawn as often, and found nowhere).
SELECT MIN(destination) AS destination, COUNT(*) AS hits
FROM {outbox} FORCE INDEX (PRIMARY)
WHERE seq IN (:seqs) AND status = 'PUBLISHED' AND attempts = 0
GROUP BY CAST(destination AS BINARY)

-- name: list
-- The newest changes first (updated_at, then seq: a stable order), at most :limit rows.
-- One branch per status, each a walk backwards over finished_idx (status, updated_at, and
-- the primary key seq, as every InnoDB secondary index ends; forced, lest the optimizer
-- read a status through status_idx and sort it) that stops after :limit rows,
-- then a sort of at most five times :limit rows; a branch whose status is not asked for
-- reads nothing. A single `status IN (...) ORDER BY updated_at` would sort every row of
-- the statuses asked for.
(SELECT seq, id, destination, topic, `key`, status, attempts, last_error, locked_by,
        created_at, updated_at, next_attempt_at, published_at
 FROM {outbox} FORCE INDEX (finished_idx)
 WHERE status = 'PENDING' AND 'PENDING' IN (:statuses)
 ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
(SELECT seq, id, destination, topic, `key`, status, attempts, last_error, locked_by,
        created_at, updated_at, next_attempt_at, published_at
 FROM {outbox} FORCE INDEX (finished_idx)
 WHERE status = 'PROCESSING' AND 'PROCESSING' IN (:statuses)
 ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
(SELECT seq, id, destination, topic, `key`, status, attempts, last_error, locked_by,
        created_at, updated_at, next_attempt_at, published_at
 FROM {outbox} FORCE INDEX (finished_idx)
 WHERE status = 'FAILED' AND 'FAILED' IN (:statuses)
 ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
(SELECT seq, id, destination, topic, `key`, status, attempts, last_error, locked_by,
        created_at, updated_at, next_attempt_at, published_at
 FROM {outbox} FORCE INDEX (finished_idx)
 WHERE status = 'ABANDONED' AND 'ABANDONED' IN (:statuses)
 ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
(SELECT seq, id, destination, topic, `key`, status, attempts, last_error, locked_by,
        created_at, updated_at, next_attempt_at, published_at
 FROM {outbox} FORCE INDEX (finished_idx)
 WHERE status = 'PUBLISHED' AND 'PUBLISHED' IN (:statuses)
 ORDER BY updated_at DESC, seq DESC LIMIT :limit)
ORDER BY updated_at DESC, seq DESC
LIMIT :limit

-- name: oldest_transaction
-- Age of the oldest open transaction on this database that wrote or locked rows (seconds):
-- a writer holding a key's lock that long holds back that key's later messages, so status
-- shows it. InnoDB's transaction list needs the PROCESS privilege (without it: 0).
-- trx_started is in the server's system time zone (InnoDB converts with localtime_r), NOW()
-- in the session's, which differs on a server set to default-time-zone = '+00:00' on a
-- host with a local clock: compared as they are, the age was off by the difference (hours,
-- or negative). So "now" is read in the system time zone too.
SELECT COALESCE(MAX(TIMESTAMPDIFF(MICROSECOND, t.trx_started,
                                  CONVERT_TZ(NOW(6), @@session.time_zone, 'SYSTEM'))),
                0) / 1000000 AS age
FROM information_schema.INNODB_TRX AS t
JOIN information_schema.PROCESSLIST AS p ON p.ID = t.trx_mysql_thread_id
WHERE p.DB = DATABASE()
  AND t.trx_mysql_thread_id <> CONNECTION_ID()
  AND (t.trx_rows_modified > 0 OR t.trx_rows_locked > 0)

-- name: inbox_claim
-- First delivery of (consumer, message_id) -> recorded (1 row). A later one fails on the
-- primary key (error 1062), which Inbox.claim answers with False; MySQL undoes just that
-- statement, the transaction goes on. In the consumer's transaction: a concurrent delivery
-- of the same message waits on the primary key until this transaction ends, then fails
-- (committed) or records it (rolled back, so the message is applied after all). Not INSERT
-- IGNORE: that would turn other errors into warnings too.
INSERT INTO {inbox} (consumer, message_id) VALUES (:consumer, :message_id)

-- name: inbox_cleanup_candidates
-- Inbox retention, step 1: at most :limit entries older than the retention, oldest first,
-- locked. Not one `DELETE … ORDER BY received_at LIMIT`: InnoDB chose a full scan and a
-- filesort for it (a single-table DELETE takes no index hint) and locked every entry it
-- read, so it waited for each consumer batch in flight (its fresh claims) and held the
-- relay's connection meanwhile. SKIP LOCKED, as PostgreSQL's: an old entry a transaction
-- holds (a redelivery's duplicate check, an operator deleting it) is left for a later round.
SELECT consumer, message_id FROM {inbox} FORCE INDEX (received_idx)
WHERE received_at < UTC_TIMESTAMP(6) - INTERVAL :retention SECOND
ORDER BY received_at
LIMIT :limit
FOR UPDATE SKIP LOCKED

-- name: inbox_cleanup
-- Inbox retention, step 2, in the same transaction: the entries step 1 locked -> deleted,
-- each looked up by its whole primary key (:picked, a derived table of their (consumer,
-- message_id), drives the join). `consumer = … AND message_id IN (…)` is no such lookup:
-- InnoDB read the whole consumer's entries for it (or the table), and waited for every
-- one a batch in flight had claimed.
DELETE old FROM (:picked) AS pick
STRAIGHT_JOIN {inbox} AS old FORCE INDEX (PRIMARY)
    ON old.consumer = pick.consumer AND old.message_id = pick.message_id


-- name: inbox_suspects_cleanup_candidates
-- Suspect retention, step 1 (the PostgreSQL file says why suspect rows need one): at most
-- :limit rows whose latest attempt (first_seen: each attempt sets it) was recorded longer
-- ago than the inbox's retention, oldest first, locked. SKIP LOCKED: a row a consumer's
-- suspect_attempt upsert or applying transaction holds is left for a later round, never
-- waited for. No index on first_seen: the table holds only the
-- redelivered messages in flight and the leftovers this deletes, and under READ COMMITTED
-- (the store's sessions) InnoDB keeps no lock on a row the WHERE turns down.
SELECT consumer, message_id FROM {inbox_suspects}
WHERE first_seen < UTC_TIMESTAMP(6) - INTERVAL :retention SECOND
ORDER BY first_seen
LIMIT :limit
FOR UPDATE SKIP LOCKED

-- name: inbox_suspects_cleanup
-- Suspect retention, step 2, in the same transaction: the rows step 1 locked -> deleted,
-- each by its whole primary key (:picked, as inbox_cleanup's), so that no row step 1 did
-- not lock is waited for.
DELETE old FROM (:picked) AS pick
STRAIGHT_JOIN {inbox_suspects} AS old FORCE INDEX (PRIMARY)
    ON old.consumer = pick.consumer AND old.message_id = pick.message_id

-- name: pending_mark
-- The wake-up probe of an idle relay (MySQL has no LISTEN/NOTIFY), every 50 ms: a mark that
-- a commit of PENDING rows changes, read at a bounded cost whatever the backlog. (A COUNT of
-- the PENDING rows read every one of them each time: thousands when keys are held behind
-- abandoned rows.) Two ends of an index and a range of at most 1024 primary-key entries
-- (EXPLAIN: "Select tables optimized away" twice, one range):
--  * pending_at: the newest updated_at of a PENDING row, the end of finished_idx's range
--    (status, updated_at): a new row, a requeue or a release to PENDING moves it; NULL:
--    nothing is PENDING (the first reading then has nothing to look at);
--  * last_seq, the end of the primary key: a new row of a later seq;
--  * recent, the rows among the last 1024 seqs: a row that took its seq before a later
--    one committed (AUTO_INCREMENT hands seqs out before commit) shows up here when it
--    commits after it, as long as fewer than 1024 seqs were taken since; later than
--    that, the relay's poll interval finds it. A claim changes none of the three but
--    pending_at (the newest PENDING row claimed): one wake-up that finds nothing.
SELECT (SELECT MAX(updated_at) FROM {outbox} WHERE status = 'PENDING') AS pending_at,
       m.last_seq,
       (SELECT COUNT(*) FROM {outbox} WHERE seq > m.last_seq - 1024) AS recent
FROM (SELECT COALESCE(MAX(seq), 0) AS last_seq FROM {outbox}) AS m

-- name: due_destinations
-- Which of :destinations have a row a claim could take now, read only: a due PENDING |
-- FAILED row, or a lease that expired. A superset of what the claim takes (a key's order,
-- held back rows and max_attempts are the claim's to judge): a destination left out has
-- nothing a claim would take at this statement's snapshot. Asked by the wake-up probe of a
-- relay of several destinations, once per change of pending_mark for all of them, and
-- always AFTER pending_mark in the same probe: a commit the mark missed is then either in
-- this answer, or after it, and it changes the next mark (mysql.py, _probe). Each
-- destination is a range of ready_idx (destination, unfinished = 1).
SELECT DISTINCT o.destination
FROM {outbox} AS o
WHERE o.destination IN (:destinations)
  AND o.unfinished = 1
  AND CASE o.status WHEN 'PROCESSING' THEN o.locked_until < UTC_TIMESTAMP(6)
                    ELSE o.next_attempt_at <= UTC_TIMESTAMP(6) END
