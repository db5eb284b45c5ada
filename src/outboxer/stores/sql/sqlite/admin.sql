-- Operators' changes by filter (outboxer.admin): purge, replay, requeue, and the counts of
-- their dry runs. Lists are JSON arrays (json_each); times are Unix seconds; :now is passed
-- in, so one statement uses one clock reading. See the PostgreSQL admin.sql for the
-- invariants. SQLite has one writer at a time: each change runs in a BEGIN IMMEDIATE
-- transaction, so no claim or settle interleaves and no destination lock is needed.

-- name: filter
-- The rows a MessageFilter matches: every criterion given holds. instr() is a
-- case-sensitive substring test (LIKE would ignore ASCII case and need its wildcards
-- escaped).
(:statuses IS NULL OR status IN (SELECT value FROM json_each(:statuses)))
AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
AND (:destinations IS NULL OR destination IN (SELECT value FROM json_each(:destinations)))
AND (:topics IS NULL OR topic IN (SELECT value FROM json_each(:topics)))
AND (:keys IS NULL OR key IN (SELECT value FROM json_each(:keys)))
AND (:older_than IS NULL OR created_at < :now - :older_than)
AND (:created_after IS NULL OR created_at >= :created_after)
AND (:created_before IS NULL OR created_at < :created_before)
AND (:error IS NULL OR instr(last_error, :error) > 0)

-- name: count_matching
-- A dry run: the rows the filter matches, by destination and status.
SELECT destination, status, count(*) AS count
FROM {outbox}
WHERE {filter}
GROUP BY destination, status

-- name: purge
-- Matching rows -> deleted, one statement; never a PROCESSING row (a relay holds it).
DELETE FROM {outbox}
WHERE {filter} AND status <> 'PROCESSING'

-- name: requeue_matching
-- ABANDONED | FAILED rows the filter matches -> PENDING, due now, attempts reset. As in
-- PostgreSQL's, a row with a later row of its key in flight stays as it is.
UPDATE {outbox} AS o
SET status = 'PENDING', attempts = 0, next_attempt_at = :now, updated_at = :now
WHERE {filter} AND status IN ('ABANDONED', 'FAILED')
  AND NOT (o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} AS f
        WHERE f.destination = o.destination AND f.key = o.key
          AND f.status = 'PROCESSING' AND f.seq > o.seq))

-- name: count_requeue_deferred
-- The ABANDONED | FAILED rows the filter matches that requeue_matching leaves as they are
-- (a later row of their key is in flight).
SELECT count(*) AS deferred
FROM {outbox} AS o
WHERE {filter} AND status IN ('ABANDONED', 'FAILED')
  AND o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} AS f
        WHERE f.destination = o.destination AND f.key = o.key
          AND f.status = 'PROCESSING' AND f.seq > o.seq)

-- name: replay_page
-- The next PUBLISHED originals after seq :after, in seq order (the rowid: each page goes on
-- where the last one stopped), inside the replay's BEGIN IMMEDIATE: nothing deletes an
-- original while it is copied, the copies keep each key's order, and they are PENDING, so
-- a later page never reads them back.
SELECT seq, id, destination, topic, key, payload, content_type, headers, created_at
FROM {outbox}
WHERE {filter} AND status = 'PUBLISHED' AND seq > :after
ORDER BY seq
LIMIT :page
