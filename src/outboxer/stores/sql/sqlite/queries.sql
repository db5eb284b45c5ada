-- SQLite queries, one named block each (see the PostgreSQL file for the invariants; they
-- are the same, without the transaction horizon: one writer at a time means seq order is
-- commit order). :now is passed in so one statement uses one clock reading. A lease (the
-- claim's token) fences settles and renewals: see the PostgreSQL migration 0006.

-- name: insert
INSERT INTO {outbox} (id, destination, topic, key, payload, content_type, headers)
VALUES (:id, :destination, :topic, :key, :payload, :content_type, :headers)

-- A claim is three statements inside one BEGIN IMMEDIATE, so no other writer interleaves;
-- each sees what the ones before it changed. See the PostgreSQL migration 0006 for the
-- invariants of each step.

-- name: abandon_expired
-- 1. PROCESSING, lease expired, attempts used up (counting the one that died) -> ABANDONED.
UPDATE {outbox}
SET status = 'ABANDONED',
    attempts = attempts + 1,
    last_error = 'abandoned after ' || (attempts + 1) || ' attempts: relay '
                 || coalesce(locked_by, '?')
                 || ' died or stalled while publishing this message (its lease expired)',
    locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = :now
WHERE destination = :destination
  AND status = 'PROCESSING'
  AND locked_until < :now
  AND attempts + 1 >= :max_attempts
RETURNING seq, id, topic, key, attempts, last_error

-- name: release_behind_abandoned
-- 1b. PROCESSING, lease expired, behind an ABANDONED row of its key -> FAILED, due now; the
-- attempt that died counts, as recover's does. The dead relay held the key's rows in one
-- batch; left in flight, such a row was never a head again (the abandoned row blocks it when
-- abandoned rows block), so it stayed PROCESSING for good: once an operator requeued the
-- abandoned row (PENDING: no longer a blocker) step 2 recovered it, and it was published,
-- before that row; and while it stayed in flight, requeue refused the abandoned row (a
-- later row of its key in flight) and purge refused it (PROCESSING): the key was stuck.
-- FAILED, it is claimed in seq order behind the abandoned row, as a row the relay released
-- when the abandoned row failed would be. Any ABANDONED row, not only those step 1 just
-- abandoned: the key's first row may have been recovered alone by an earlier claim and
-- abandoned by its settle (a permanent refusal), its batch-mates still under the dead
-- lease (PostgreSQL's migration 0009 tests the same).
-- Run only when abandoned rows block: otherwise such a row heads its key and is
-- recovered alone (step 2). A row this attempt would use up is left to the next
-- claim's abandon_expired (ABANDONED, not FAILED at max_attempts).
UPDATE {outbox} AS t
SET attempts = attempts + 1,
    last_error = 'relay ' || coalesce(locked_by, '?')
                 || ' died or stalled while publishing this message (its lease expired)',
    status = 'FAILED',
    next_attempt_at = :now,
    locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = :now
WHERE t.destination = :destination
  AND t.status = 'PROCESSING'
  AND t.locked_until < :now
  AND t.attempts + 1 < :max_attempts
  AND t.key IS NOT NULL
  AND EXISTS (SELECT 1 FROM {outbox} AS a
              WHERE a.destination = t.destination
                AND a.key = t.key
                AND a.status = 'ABANDONED'
                AND a.seq < t.seq)

-- name: expired_head
-- 2. The earliest row whose lease expired and that heads its key (no earlier row of its key
-- in flight or failed, nor abandoned when abandoned rows block; no PENDING row of a key
-- comes before a row in flight): recovered alone, below.
SELECT o.seq FROM {outbox} AS o
WHERE o.destination = :destination
  AND o.status = 'PROCESSING'
  AND o.locked_until < :now
  AND (o.key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {outbox} AS b
        WHERE b.destination = o.destination
          AND b.key = o.key
          AND b.status IN ('PROCESSING', 'FAILED', 'ABANDONED')
          AND b.seq < o.seq
          AND (b.status <> 'ABANDONED' OR :abandoned_blocks)))
ORDER BY o.seq
LIMIT 1

-- name: recover
-- 2. That row -> PROCESSING under this claim's lease, alone; the attempt that died counts.
UPDATE {outbox}
SET locked_by = :relay_id,
    lease = :lease,
    locked_until = :now + :lock_seconds,
    attempts = attempts + 1,
    last_error = 'relay ' || coalesce(locked_by, '?')
                 || ' died or stalled while publishing this message (its lease expired)',
    updated_at = :now
WHERE seq = :seq AND status = 'PROCESSING'
RETURNING seq, id, destination, topic, key, payload, content_type, headers,
          attempts, created_at

-- name: claim
-- 3. PENDING | FAILED (due) -> PROCESSING under this claim's lease. A row in flight is
-- never taken here (step 2 recovers it, alone) and holds back its key's later rows even
-- once its lease expired. An earlier PENDING row not yet due (a released row whose
-- next_attempt_at a settle set from a later clock reading, or a clock stepped back) holds
-- them back too: key order does not rest on every relay's clock agreeing.
-- The byte budget: of those rows, in seq order, it takes each while the payload bytes of
-- the rows before it stay under :max_bytes: at most :max_bytes plus one row, at least one
-- row (a larger payload goes alone), and a seq-order prefix, so no key's later row is
-- taken without its earlier one. length() of a BLOB reads its size from the record header,
-- not its overflow pages.
UPDATE {outbox}
SET status = 'PROCESSING',
    locked_by = :relay_id,
    lease = :lease,
    locked_until = :now + :lock_seconds,
    updated_at = :now
WHERE seq IN (
    SELECT d.seq
    FROM (SELECT c.seq, sum(c.bytes) OVER (
                  ORDER BY c.seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS bytes_before
          FROM (
          SELECT o.seq, length(o.payload) AS bytes FROM {outbox} AS o
          WHERE o.destination = :destination
            -- ready_idx's condition word for word (its rows in seq order), then its part.
            AND o.status IN ('PENDING', 'FAILED', 'PROCESSING') AND o.status <> 'PROCESSING'
            AND o.next_attempt_at <= :now
            AND (o.key IS NULL OR NOT EXISTS (
                  SELECT 1 FROM {outbox} AS b
                  WHERE b.destination = o.destination
                    AND b.key = o.key
                    AND b.status IN ('PROCESSING', 'PENDING', 'FAILED', 'ABANDONED')
                    AND b.seq < o.seq
                    AND CASE b.status WHEN 'PROCESSING' THEN 1
                                      WHEN 'PENDING' THEN b.next_attempt_at > :now
                                      WHEN 'FAILED' THEN b.next_attempt_at > :now
                                      ELSE :abandoned_blocks END))
          ORDER BY o.seq
          LIMIT :limit) AS c) AS d
    WHERE coalesce(d.bytes_before, 0) < :max_bytes)
RETURNING seq, id, destination, topic, key, payload, content_type, headers,
          attempts, created_at

-- name: renew
-- PROCESSING under this lease -> locked until :lock_seconds from now: one statement, by the
-- lease holder only (a stale holder never takes back a row another claim holds).
UPDATE {outbox}
SET locked_until = :now + :lock_seconds
WHERE seq IN (SELECT value FROM json_each(:seqs))
  AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: settle_published
-- PROCESSING -> PUBLISHED, only by the holder of the row's lease.
UPDATE {outbox}
SET status = 'PUBLISHED', published_at = :now, updated_at = :now,
    locked_by = NULL, locked_until = NULL, lease = NULL
WHERE seq = :seq AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: settle_failed
-- PROCESSING -> FAILED with backoff, or ABANDONED (permanent, or attempts used up).
UPDATE {outbox}
SET attempts = attempts + 1,
    last_error = :error,
    status = CASE WHEN :permanent OR attempts + 1 >= :max_attempts THEN 'ABANDONED' ELSE 'FAILED' END,
    next_attempt_at = :now + :delay,
    locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = :now
WHERE seq = :seq AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: release
-- PROCESSING -> claimable again without counting an attempt.
UPDATE {outbox}
SET status = CASE WHEN attempts > 0 THEN 'FAILED' ELSE 'PENDING' END,
    next_attempt_at = :now, locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = :now
WHERE seq = :seq AND status = 'PROCESSING' AND lease = :lease AND locked_by = :relay_id

-- name: cleanup
-- PUBLISHED | ABANDONED -> deleted once older than the retention, :limit rows a statement,
-- oldest first through finished_idx. SQLite uses that partial index only for a WHERE
-- clause that repeats its condition (:status alone would make it read the whole table).
DELETE FROM {outbox}
WHERE seq IN (
    SELECT seq FROM {outbox}
    WHERE status = :status AND status IN ('PUBLISHED', 'ABANDONED')
      AND updated_at < :now - :retention
    ORDER BY updated_at
    LIMIT :limit)

-- name: counts
-- Every row, counted exactly: a pass over the whole table. Only for a small table (see
-- seq_range); a big one is counted by counts_tally and sample_published.
SELECT destination, status, count(*) AS count,
       sum(CASE WHEN attempts > 0 THEN 1 ELSE 0 END) AS retried,
       :now - min(created_at) AS oldest_age
FROM {outbox}
GROUP BY destination, status

-- name: seq_range
-- The first and last seq: the two ends of the table's rowid b-tree. last - first + 1
-- bounds the rows (counts reads them all when it is small) and spans sample_published's draw.
SELECT (SELECT min(seq) FROM {outbox}) AS first_seq, (SELECT max(seq) FROM {outbox}) AS last_seq

-- name: counts_tally
-- Exact counts of every row but the PUBLISHED ones of a first attempt: the unfinished and
-- ABANDONED rows and the PUBLISHED ones that were retried, with the oldest created_at.
-- A covering scan of the partial status_idx, whose condition this WHERE clause repeats
-- (migration 0005): its cost follows the backlog, not the published history.
SELECT destination, status, count(*) AS count,
       sum(CASE WHEN attempts > 0 THEN 1 ELSE 0 END) AS retried,
       :now - min(created_at) AS oldest_age
FROM {outbox}
WHERE status <> 'PUBLISHED' OR attempts > 0
GROUP BY destination, status

-- name: sample_published
-- The PUBLISHED rows of a first attempt among :seqs (a JSON array of seqs drawn at random
-- between the first and the last: stores.base.sample_seqs), per destination: rowid
-- lookups, one per seq. Their share of the draw estimates their share of the range.
SELECT destination, count(*) AS hits
FROM {outbox}
WHERE seq IN (SELECT value FROM json_each(:seqs)) AND status = 'PUBLISHED' AND attempts = 0
GROUP BY destination

-- name: list
-- The newest changes first (updated_at, then seq: a stable order), at most :limit rows.
-- One branch per status, each a walk backwards over an index that stops after :limit rows
-- (status_idx, whose condition the branch repeats; finished_idx for PUBLISHED), then a sort
-- of at most five times :limit rows; a branch whose status is not asked for (:list_<status>
-- false, a constant SQLite tests once, before the walk) reads nothing. A single
-- `status IN (...) ORDER BY updated_at` would sort every row of the statuses asked for.
SELECT * FROM (
    SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
           created_at, updated_at, next_attempt_at, published_at
    FROM {outbox}
    WHERE status = 'PENDING' AND (status <> 'PUBLISHED' OR attempts > 0)
      AND :list_pending
    ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
SELECT * FROM (
    SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
           created_at, updated_at, next_attempt_at, published_at
    FROM {outbox}
    WHERE status = 'PROCESSING' AND (status <> 'PUBLISHED' OR attempts > 0)
      AND :list_processing
    ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
SELECT * FROM (
    SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
           created_at, updated_at, next_attempt_at, published_at
    FROM {outbox}
    WHERE status = 'FAILED' AND (status <> 'PUBLISHED' OR attempts > 0)
      AND :list_failed
    ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
SELECT * FROM (
    SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
           created_at, updated_at, next_attempt_at, published_at
    FROM {outbox}
    WHERE status = 'ABANDONED' AND (status <> 'PUBLISHED' OR attempts > 0)
      AND :list_abandoned
    ORDER BY updated_at DESC, seq DESC LIMIT :limit)
UNION ALL
SELECT * FROM (
    SELECT seq, id, destination, topic, key, status, attempts, last_error, locked_by,
           created_at, updated_at, next_attempt_at, published_at
    FROM {outbox}
    WHERE status = 'PUBLISHED' AND status IN ('PUBLISHED', 'ABANDONED')
      AND :list_published
    ORDER BY updated_at DESC, seq DESC LIMIT :limit)
ORDER BY updated_at DESC, seq DESC
LIMIT :limit

-- name: requeue
-- ABANDONED | FAILED -> PENDING, due now, attempts reset: an operator's decision.
-- :statuses narrows it; the status test is repeated so that no caller's list requeues a
-- PROCESSING row (a relay holds it) or a PUBLISHED one (sent again): see PostgreSQL's.
-- A row with a later row of its key in flight stays as it is: see admin.sql,
-- requeue_matching.
UPDATE {outbox} AS o
SET status = 'PENDING', attempts = 0, next_attempt_at = :now, updated_at = :now
WHERE destination IN (SELECT value FROM json_each(:destinations))
  AND status IN (SELECT value FROM json_each(:statuses))
  AND status IN ('ABANDONED', 'FAILED')
  AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
  AND NOT (o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} AS f
        WHERE f.destination = o.destination AND f.key = o.key
          AND f.status = 'PROCESSING' AND f.seq > o.seq))

-- name: inbox_claim
-- First delivery of (consumer, message_id) -> recorded (1 row); later ones -> 0 rows.
INSERT INTO {inbox} (consumer, message_id) VALUES (:consumer, :message_id)
ON CONFLICT DO NOTHING

-- name: inbox_cleanup
DELETE FROM {inbox}
WHERE rowid IN (
    SELECT rowid FROM {inbox}
    WHERE received_at < :now - :retention
    ORDER BY received_at
    LIMIT :limit)


-- name: inbox_suspects_cleanup
-- Suspect rows whose latest attempt (first_seen: each attempt sets it) was recorded longer
-- ago than the inbox's retention -> deleted, :limit a statement (the PostgreSQL file says
-- why). SQLite has one writer at a time: no row lock to skip, the statement waits
-- busy_timeout for the write lock as inbox_cleanup does.
DELETE FROM {inbox_suspects}
WHERE rowid IN (
    SELECT rowid FROM {inbox_suspects}
    WHERE first_seen < :now - :retention
    ORDER BY first_seen
    LIMIT :limit)

-- name: due_destinations
-- Which of :destinations (a JSON array) have a row a claim could take now, read only: a
-- due PENDING | FAILED row, or a lease that expired. A superset of what the claim takes (a
-- key's order, held back rows and max_attempts are the claim's to judge): a destination
-- left out has nothing a claim would take at this statement's snapshot. Asked by the
-- wake-up probe of a relay of several destinations when PRAGMA data_version changed, once
-- for all of them, and AFTER reading the version: a commit the version missed is then
-- either in this answer, or after it, and it changes the next version (sqlite.py, _probe).
-- Each destination is a range of ready_idx (destination, seq).
SELECT d.value AS destination
FROM json_each(:destinations) AS d
WHERE EXISTS (
    SELECT 1 FROM {outbox} AS o
    WHERE o.destination = d.value
      AND o.status IN ('PENDING', 'FAILED', 'PROCESSING')
      AND CASE o.status WHEN 'PROCESSING' THEN o.locked_until < :now
                        ELSE o.next_attempt_at <= :now END)
