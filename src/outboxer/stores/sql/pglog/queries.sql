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
