-- Operators' changes by filter (outboxer.admin): purge, replay, requeue, and the counts of
-- their dry runs. Parameters are :name; a list parameter expands to one placeholder per
-- item and is never empty, so each list comes with a flag :any_NAME that says the criterion
-- is left out (its list then holds one dummy item). Tokens in braces are backquoted names,
-- and {filter} is the block below. See the PostgreSQL admin.sql for the invariants; the
-- differences are noted here. Comment lines are not sent.

-- name: filter
-- The rows a MessageFilter matches: every criterion given holds. Strings compare byte for
-- byte, as in PostgreSQL; LOCATE on last_error is case-sensitive for the same reason.
-- The columns' utf8mb4_bin collation pads with spaces, so `key` IN ('a') also matched 'a ':
-- a purge, requeue, replay or count of one key reached another. Each IN is repeated on
-- BINARY (no padding), the plain one kept for the optimizer. Times are UTC, as every
-- DATETIME(6) here.
(:any_status OR status IN (:statuses))
AND (:any_id OR id IN (:ids))
AND (:any_destination OR (destination IN (:destinations)
                          AND BINARY destination IN (:destinations)))
AND (:any_topic OR (topic IN (:topics) AND BINARY topic IN (:topics)))
AND (:any_key OR (`key` IN (:keys) AND BINARY `key` IN (:keys)))
AND (:older_than IS NULL OR created_at < UTC_TIMESTAMP(6) - INTERVAL :older_than SECOND)
AND (:created_after IS NULL OR created_at >= :created_after)
AND (:created_before IS NULL OR created_at < :created_before)
AND (:error IS NULL OR LOCATE(:error, last_error) > 0)

-- name: count_matching
-- A dry run: the rows the filter matches, by destination (its bytes: see queries.sql) and
-- status. A plain read.
SELECT MIN(destination) AS destination, status, COUNT(*) AS count
FROM {outbox}
WHERE {filter}
GROUP BY CAST(destination AS BINARY), status

-- name: destinations_matching
-- The destinations whose shared lock (a row of {destinations}) a purge or requeue takes
-- before it changes rows, in name order.
SELECT DISTINCT destination FROM {outbox} WHERE {filter} ORDER BY destination

-- name: purge
-- Matching rows -> deleted, one statement, in the transaction holding the shared lock of
-- each destination in :locked. Never a PROCESSING row (a relay holds it); only rows of a
-- locked destination (a claim never sees the change half-done).
DELETE FROM {outbox}
WHERE {filter}
  AND destination IN (:locked)
  AND status <> 'PROCESSING'

-- name: requeue_matching
-- ABANDONED | FAILED rows the filter matches -> PENDING, due now, attempts reset: one
-- statement under the shared lock of each destination in :locked. As in PostgreSQL's, a
-- row with a later row of its key in flight stays as it is. MySQL refuses a subquery on
-- the table an UPDATE changes (error 1093), so the in-flight keys are a derived table,
-- materialized by its GROUP BY: each key's last seq in flight, its bytes as the key (the
-- column's collation would take 'a ' for 'a'; the destination's bytes likewise).
UPDATE {outbox}
LEFT JOIN (SELECT CAST(destination AS BINARY) AS flight_destination,
                  CAST(`key` AS BINARY) AS flight_key, MAX(seq) AS flight_last
           FROM {outbox}
           WHERE destination IN (:locked) AND blocker = 1 AND status = 'PROCESSING'
             AND `key` IS NOT NULL
           GROUP BY CAST(destination AS BINARY), CAST(`key` AS BINARY)) AS in_flight
  ON in_flight.flight_destination = CAST(destination AS BINARY)
 AND in_flight.flight_key = CAST(`key` AS BINARY)
SET status = 'PENDING', attempts = 0, next_attempt_at = UTC_TIMESTAMP(6),
    updated_at = UTC_TIMESTAMP(6)
WHERE {filter}
  AND destination IN (:locked)
  AND status IN ('ABANDONED', 'FAILED')
  AND (in_flight.flight_last IS NULL OR in_flight.flight_last < seq)

-- name: count_requeue_deferred
-- The ABANDONED | FAILED rows the filter matches that requeue_matching leaves as they are
-- (a later row of their key is in flight). A plain read.
SELECT COUNT(*) AS deferred
FROM {outbox} AS o
WHERE {filter}
  AND status IN ('ABANDONED', 'FAILED')
  AND `key` IS NOT NULL
  AND EXISTS (SELECT 1 FROM {outbox} AS f
              WHERE f.destination = o.destination
                AND BINARY f.destination = BINARY o.destination AND f.blocker = 1
                AND f.`key` = o.`key` AND BINARY f.`key` = o.`key`
                AND f.status = 'PROCESSING' AND f.seq > o.seq)

-- name: replay_keys
-- The keys a replay will copy: the store locks their slots (queries.sql: key_lock), sorted,
-- before its first insert, so a replay and writers that share keys never deadlock.
-- DISTINCT `key` alone gave 'a' and 'a ' as one key (padded comparison), so the slot of
-- the other was left unlocked; with the byte length, rows that are one in a pair are
-- byte for byte the same key.
SELECT DISTINCT `key`, LENGTH(`key`) AS key_bytes FROM {outbox}
WHERE {filter} AND status = 'PUBLISHED' AND `key` IS NOT NULL

-- name: replay_seqs
-- The PUBLISHED originals a replay copies, in seq order: their seqs only (the copies are
-- read by replay_page). One query, so the optimizer picks the filter's best index once
-- (the id index for ids, the primary key for a range); paging this query with LIMIT would
-- sort the matching rows again for every page when it chooses another index than the
-- primary key.
SELECT seq FROM {outbox}
WHERE {filter} AND status = 'PUBLISHED'
ORDER BY seq

-- name: replay_page
-- One page of those originals, by primary key, locked in share mode until the replay
-- commits. The invariants of the PostgreSQL replay_originals hold: copies inserted page
-- after page keep each key's order; an original (and so its claim-check object) cannot be
-- deleted while it is copied (retention's DELETE waits for the replay), and one deleted
-- since replay_seqs read it is no longer PUBLISHED here and is not copied; the copies are
-- PENDING and never read back.
SELECT seq, id, destination, topic, `key`, payload, content_type, headers, created_at
FROM {outbox}
WHERE seq IN (:seqs) AND status = 'PUBLISHED'
ORDER BY seq
LOCK IN SHARE MODE
