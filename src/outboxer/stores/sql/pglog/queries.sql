-- Log mode queries (see migrations/0001_log.sql for the invariants).

-- name: lock_keys
-- Every key of a multi-message write, locked in one global order (sorted) before any row
-- is written, so two writers sharing keys never deadlock whatever their callers' order.
INSERT INTO {keys} AS held (key, last_xid)
SELECT k.key, pg_current_xact_id()
FROM (SELECT DISTINCT unnest(CAST(:keys AS text[])) AS key) AS k
WHERE k.key IS NOT NULL
ORDER BY k.key
ON CONFLICT (key) DO UPDATE SET last_xid = greatest(held.last_xid, EXCLUDED.last_xid)

-- name: insert
-- Appends one row in the caller's transaction. For a keyed row the key's row in {keys}
-- is upserted first and stays locked until commit: a second writer of the key waits
-- there, then reads the first one's order_xid and takes at least that, and its position
-- is taken only after the wait (the join below must produce a row before the INSERT
-- projects it, and the identity default is computed at projection). So a key's rows
-- read in commit order, whatever order the writers got their xids in.
WITH key_xid AS MATERIALIZED (
    INSERT INTO {keys} AS held (key, last_xid)
    SELECT CAST(:key AS text), pg_current_xact_id()
    WHERE CAST(:key AS text) IS NOT NULL
    ON CONFLICT (key) DO UPDATE SET last_xid = greatest(held.last_xid, EXCLUDED.last_xid)
    RETURNING last_xid)
INSERT INTO {log} (order_xid, id, topic, key, payload, content_type, headers)
SELECT coalesce(k.last_xid, pg_current_xact_id()), CAST(:id AS uuid), CAST(:topic AS text),
       CAST(:key AS text), CAST(:payload AS bytea), CAST(:content_type AS text),
       CAST(:headers AS jsonb)
FROM (SELECT 1) AS one LEFT JOIN key_xid AS k ON true

-- name: read
-- The rows after a reader's offset that no running transaction can still precede:
-- order_xid below the snapshot's xmin (every transaction below it has finished).
SELECT CAST(order_xid AS text) AS order_xid, position, id, topic, key, payload,
       content_type, CAST(headers AS text) AS headers, created_at
FROM {log}
WHERE (order_xid, position) > (CAST(:after_xid AS xid8), CAST(:after_position AS bigint))
  AND order_xid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY order_xid, position
LIMIT :limit

-- name: register_reader
INSERT INTO {offsets} (reader) VALUES (:reader) ON CONFLICT (reader) DO NOTHING

-- name: get_offset
SELECT CAST(order_xid AS text) AS order_xid, position FROM {offsets} WHERE reader = :reader

-- name: commit_offset
-- Forward only: a stale relay (or a late confirm) never moves a reader back.
UPDATE {offsets}
SET order_xid = CAST(:order_xid AS xid8), position = :position, updated_at = now()
WHERE reader = :reader
  AND (order_xid, position) < (CAST(:order_xid AS xid8), CAST(:position AS bigint))

-- name: set_offset
-- Replay (or skip ahead): an operator moves a reader's offset either way.
INSERT INTO {offsets} (reader, order_xid, position) VALUES (:reader, CAST(:order_xid AS xid8), :position)
ON CONFLICT (reader) DO UPDATE
SET order_xid = EXCLUDED.order_xid, position = EXCLUDED.position, updated_at = now()

-- name: first_since
-- The first row in reading order written at or after a time.
SELECT CAST(order_xid AS text) AS order_xid, position FROM {log}
WHERE created_at >= :since
ORDER BY order_xid, position
LIMIT 1

-- name: slowest_offset
SELECT CAST(order_xid AS text) AS order_xid, position FROM {offsets}
ORDER BY order_xid, position LIMIT 1

-- name: partitions
SELECT c.relname AS name, pg_get_expr(c.relpartbound, c.oid) AS bound
FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = CAST(:log AS regclass)
ORDER BY c.relname

-- name: readers
SELECT reader, CAST(order_xid AS text) AS order_xid, position, updated_at
FROM {offsets} ORDER BY reader

-- name: backlog
-- How far a reader is behind: the rows after its offset (counted up to :limit, so a
-- status query never scans a huge backlog) and when the first of them was written.
SELECT
    (SELECT count(*) FROM (
        SELECT 1 FROM {log}
        WHERE (order_xid, position) > (CAST(:order_xid AS xid8), CAST(:position AS bigint))
        LIMIT :limit) AS behind_rows) AS behind,
    (SELECT created_at FROM {log}
     WHERE (order_xid, position) > (CAST(:order_xid AS xid8), CAST(:position AS bigint))
     ORDER BY order_xid, position LIMIT 1) AS oldest

-- Partition upkeep (PgLog.ensure_partitions). Every DDL step runs in a transaction of its
-- own under a short lock_timeout: DDL waiting for a lock on the log holds every later
-- statement on it (writers' too) behind it, so it gives up and the next upkeep tries again.
-- Tokens {partition}, {lower}, {upper} (timestamp literals the code formats itself: DDL
-- takes no parameters) and {helper} are filled in by the code.

-- name: upkeep_lock
-- One upkeep of a log at a time, whichever reader's relay (or schema apply) runs it: the
-- helper constraint below is one per log, and one upkeep must not drop another's.
SELECT pg_try_advisory_lock(hashtextextended(:key, 0))

-- name: upkeep_unlock
SELECT pg_advisory_unlock(hashtextextended(:key, 0))

-- name: default_holds_rows
-- Normally false at once: the default partition holds only rows no partition covered when
-- they were written.
SELECT EXISTS (SELECT 1 FROM {default_partition})

-- name: default_days
-- The default partition's rows by UTC day: every one of them is of a day that had no
-- partition when it was written, and has none since (a partition can be attached only
-- while the default partition holds no row of its range). A sequential scan, under ACCESS
-- SHARE only: writers and readers of the log do not wait for it.
SELECT CAST(date_trunc('day', created_at AT TIME ZONE 'UTC') AS date) AS day,
       count(*) AS rows
FROM {default_partition}
GROUP BY 1
ORDER BY 1

-- name: helper_left
SELECT EXISTS (SELECT 1 FROM pg_constraint
               WHERE conrelid = to_regclass(:default_partition) AND conname = :helper)

-- name: lock_log
-- A day starting soon (today's, when the upkeep did not run for days_ahead days) may get
-- rows any moment: its partition is created with the log's writers held back, so that none
-- routes a row of the day to the default partition while it is attached (its transaction
-- would fail on the default partition's new constraint), and only while the default
-- partition is small (count_default): the creation scans it under this lock.
LOCK TABLE ONLY {log} IN ACCESS EXCLUSIVE MODE

-- name: count_default
-- At most :limit rows counted: bounded work under the log's lock.
SELECT count(*) FROM (SELECT 1 FROM {default_partition} LIMIT :limit) AS sample

-- name: create_partition
-- Under lock_log: scans the default partition for rows of the range (it fails,
-- check_violation, if there is one).
CREATE TABLE {partition} PARTITION OF {log} FOR VALUES FROM ({lower}) TO ({upper})

-- name: add_helper
-- Only while the default partition holds more than LOCKED_SCAN_ROWS rows (otherwise:
-- lock_default, in one transaction). A day starting well after now (ATTACH_AHEAD) is
-- attached without the writers held back,
-- and without the default partition's scan under ACCESS EXCLUSIVE that ATTACH (as CREATE
-- TABLE ... PARTITION OF) makes otherwise: the default partition first gets a CHECK that
-- excludes the days' range. NOT VALID: added under a brief ACCESS EXCLUSIVE on the default
-- partition only (no scan), then validated (validate_helper) under SHARE UPDATE EXCLUSIVE,
-- which no writer or reader waits for; ATTACH then finds the default partition's new
-- constraint implied by it, and scans nothing. From this commit on, the constraint refuses
-- a row of the range in the default partition: no writer writes one, as created_at is the
-- writer's transaction start, hours before the range; it is dropped in the transaction that
-- attaches the partitions, or, given up, at once or at the next upkeep (before the range
-- begins: ATTACH_AHEAD).
ALTER TABLE {default_partition} ADD CONSTRAINT {helper}
    CHECK (created_at < {lower} OR created_at >= {upper}) NOT VALID

-- name: validate_helper
-- Scans the default partition (check_violation if it holds a row of the range).
ALTER TABLE {default_partition} VALIDATE CONSTRAINT {helper}

-- name: hold_attach
-- The lock ATTACH takes on the log, taken first so that the partitions listed next are
-- those the ATTACH meets (another upkeep's CREATE ... PARTITION OF commits before it).
-- Writers (ROW EXCLUSIVE) and readers (ACCESS SHARE) do not wait for it.
LOCK TABLE ONLY {log} IN SHARE UPDATE EXCLUSIVE MODE

-- name: lock_default
-- attach_ahead_locked: ATTACH's lock on the default partition, taken before the count so
-- that no row arrives between it and the ATTACH's scan. Writers routing rows to the default
-- partition (days the upkeep missed) and readers of the log wait for that scan only: at
-- most LOCKED_SCAN_ROWS rows. Nothing is committed before the ATTACH, so an upkeep lost
-- midway (relay killed, connection cut) leaves nothing behind, unlike add_helper, whose
-- CHECK, committed, refuses the rows of its days once they begin until an upkeep drops it.
LOCK TABLE ONLY {default_partition} IN ACCESS EXCLUSIVE MODE

-- name: create_standalone
-- A partition as CREATE TABLE ... PARTITION OF makes it (columns, defaults, NOT NULL,
-- storage, indexes: the same catalog entries), made outside the log: nothing waits for it.
-- Without the identity: a partition has none of its own (the log's gives position), and
-- LIKE's would give it a sequence of its own.
CREATE TABLE {partition} (LIKE {log} INCLUDING ALL EXCLUDING IDENTITY)

-- name: attach_partition
-- SHARE UPDATE EXCLUSIVE on the log; ACCESS EXCLUSIVE on the default partition and on the
-- new (empty) table, each held for catalog changes only, the default's scan being skipped
-- thanks to the validated helper.
ALTER TABLE {log} ATTACH PARTITION {partition} FOR VALUES FROM ({lower}) TO ({upper})

-- name: drop_helper
ALTER TABLE {default_partition} DROP CONSTRAINT IF EXISTS {helper}
