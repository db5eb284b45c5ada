-- Operators' changes by filter (outboxer.admin): purge, replay, requeue, and the counts of
-- their dry runs. Parameters are :name; tokens in braces are quoted names, and {filter} is
-- the block below. The filter arrives checked (outboxer.admin.MessageFilter).

-- name: filter
-- The rows a MessageFilter matches: every criterion given holds; a NULL one is left out.
-- A list matches any of its values. older_than is measured with the database's clock, as
-- retention is; created_after is inclusive, created_before exclusive. error is a
-- case-sensitive substring of last_error (strpos: no LIKE wildcards to escape).
(CAST(:statuses AS text[]) IS NULL OR status = ANY(CAST(:statuses AS text[])))
AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
AND (CAST(:destinations AS text[]) IS NULL OR destination = ANY(CAST(:destinations AS text[])))
AND (CAST(:topics AS text[]) IS NULL OR topic = ANY(CAST(:topics AS text[])))
AND (CAST(:keys AS text[]) IS NULL OR key = ANY(CAST(:keys AS text[])))
AND (CAST(:older_than AS float8) IS NULL
     OR created_at < now() - make_interval(secs => CAST(:older_than AS float8)))
AND (CAST(:created_after AS timestamptz) IS NULL
     OR created_at >= CAST(:created_after AS timestamptz))
AND (CAST(:created_before AS timestamptz) IS NULL
     OR created_at < CAST(:created_before AS timestamptz))
AND (CAST(:error AS text) IS NULL OR strpos(last_error, CAST(:error AS text)) > 0)

-- name: count_matching
-- A dry run: the rows the filter matches, by destination and status. A plain read.
SELECT destination, status, count(*) AS count
FROM {outbox}
WHERE {filter}
GROUP BY destination, status

-- name: destinations_matching
-- The destinations whose shared lock a purge or requeue takes before it changes rows.
SELECT DISTINCT destination FROM {outbox} WHERE {filter} ORDER BY destination

-- name: purge
-- Matching rows -> deleted, in one statement, in the transaction that holds the shared
-- destination lock of each destination in :locked (taken in name order; a claim holds one
-- destination's lock at a time, so they cannot deadlock). Invariants:
--  * never a PROCESSING row, whatever the filter says: a relay holds it and is publishing
--    it; its settle would find nothing and the broker would get a message the outbox no
--    longer has;
--  * only rows of a locked destination: a claim, which takes its destination's lock
--    exclusively, never sees this change half-done. It would otherwise pass over (SKIP
--    LOCKED) a key's row this statement holds and claim that key's next row: overtaking it
--    if the purge then rolled back. A destination that gained its first matching row since
--    destinations_matching read them is left for the next run.
DELETE FROM {outbox}
WHERE {filter}
  AND destination = ANY(CAST(:locked AS text[]))
  AND status <> 'PROCESSING'

-- name: requeue_matching
-- ABANDONED | FAILED rows the filter matches -> PENDING, due now, attempts reset: an
-- operator's decision, one statement under the shared lock of each destination in :locked
-- (see purge for why the lock, and why only those destinations). The status test is
-- repeated here: whatever the filter, no other status is requeued. Invariant: a row is
-- requeued only while no LATER row of its key (and destination) is in flight; such a row
-- stays as it is (count_requeue_deferred counts it) until the key's in-flight rows are
-- settled. Made PENDING before them, it heads its key for the claim, which took it at
-- once: two rows of one key in flight together, reaching the broker in either order (with
-- abandoned_blocks_key off a key moves on past its ABANDONED rows, so this happens). The
-- shared lock keeps the test true until commit: only a claim, which needs the lock
-- exclusively, puts rows in flight; settles only take rows out of it.
UPDATE {outbox} AS o
SET status = 'PENDING', attempts = 0, next_attempt_at = now(), updated_at = now()
WHERE {filter}
  AND destination = ANY(CAST(:locked AS text[]))
  AND status IN ('ABANDONED', 'FAILED')
  AND NOT (o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} AS f
        WHERE f.destination = o.destination AND f.key = o.key
          AND f.status = 'PROCESSING' AND f.seq > o.seq))

-- name: count_requeue_deferred
-- The ABANDONED | FAILED rows the filter matches that requeue_matching leaves as they are:
-- a later row of their key is in flight. A plain read (a dry run's, or after the requeue in
-- its transaction, under its locks).
SELECT count(*) AS deferred
FROM {outbox} AS o
WHERE {filter}
  AND status IN ('ABANDONED', 'FAILED')
  AND o.key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {outbox} AS f
        WHERE f.destination = o.destination AND f.key = o.key
          AND f.status = 'PROCESSING' AND f.seq > o.seq)

-- name: replay_key_locks
-- A replay's first statement: the key lock (queries.sql, insert) of every key it will copy,
-- taken up front in one global order (by lock id; a volatile function in a sorted SELECT
-- list runs after the sort), so a replay and writers that share keys never deadlock. The
-- inserts lock each key again, which costs nothing: the transaction holds it already.
-- Writers of these keys wait for the replay's commit: their rows come after the copies.
-- With more keys than :max_key_locks it locks none and says how many there are: the
-- replay then takes queries.sql's table_lock instead and its inserts lock no key.
WITH ids AS MATERIALIZED (
    SELECT DISTINCT hashtextextended('outboxer-key:' || key, 0) AS lock_id
    FROM {outbox}
    WHERE {filter} AND status = 'PUBLISHED' AND key IS NOT NULL),
locked AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(ids.lock_id)
    FROM ids
    WHERE (SELECT count(*) FROM ids) <= :max_key_locks
    ORDER BY ids.lock_id)
SELECT (SELECT count(*) FROM ids) AS keys, (SELECT count(*) FROM locked) AS locked

-- name: replay_originals
-- The PUBLISHED originals in seq order (a key's publish order), read through a cursor a
-- page at a time (one scan and sort, however many pages: no index orders the published
-- history by seq), each row locked FOR SHARE as it is read, until the replay commits.
-- Invariants:
--  * copies are inserted page after page in this order, so their seqs keep each key's
--    order (the copies of one key come out of the relay as their originals did);
--  * an original cannot be deleted (retention, a purge) while the replay copies it, so its
--    claim-check object, which the sweep deletes only once no row refers to it, is there to
--    be copied. Retention's DELETE passes over locked rows (SKIP LOCKED);
--  * the copies are PENDING: the cursor never reads them back.
SELECT seq, id, destination, topic, key, payload, content_type, CAST(headers AS text) AS headers,
       created_at
FROM {outbox}
WHERE {filter} AND status = 'PUBLISHED'
ORDER BY seq
FOR SHARE
