-- Upkeep of the partitioned layout (outboxer.stores.pgpartitions): partitions made ahead,
-- rows moved out of the default partition, partitions past retention dropped. Tokens in
-- braces are quoted names, and {lower}/{upper} timestamp literals that the code formats
-- itself (DDL takes no parameters). Each change runs in a transaction of its own, under
-- the maintenance lock (`maintenance_lock`) and a short lock_timeout: DDL that waits
-- behind a long transaction queues every writer behind it, so it gives up instead and
-- the next round tries again.

-- name: maintenance_lock
-- One upkeep at a time per table, whichever relay or `outboxer cleanup` runs it: two would
-- create the same partition, or one would drop what the other is moving rows into.
SELECT pg_advisory_xact_lock(CAST(:lock_key AS bigint))

-- name: layout
-- 'p': the partitioned layout; 'r': the default table; NULL: no table yet.
SELECT CAST(c.relkind AS text) AS kind
FROM pg_class AS c
WHERE c.oid = to_regclass(:outbox)

-- name: partitions
-- The partitions with their bounds (NULL for the default partition) and PostgreSQL's
-- estimate of their rows (-1: never analyzed). The bounds come back as text in this
-- session's DateStyle and time zone, and are read back as timestamptz in the same session.
SELECT c.relname AS name,
       CAST(b.bound[1] AS timestamptz) AS lower,
       CAST(b.bound[2] AS timestamptz) AS upper,
       CAST(c.reltuples AS bigint) AS estimated_rows
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
CROSS JOIN LATERAL (
    SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid),
                        'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)') AS bound) AS b
WHERE i.inhparent = to_regclass(:outbox)
ORDER BY 2 NULLS FIRST

-- name: columns
-- The table's columns in order, for moving rows between partitions by name.
SELECT a.attname AS name
FROM pg_attribute AS a
WHERE a.attrelid = to_regclass(:outbox) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum

-- name: default_rows
-- The rows of the default partition by the partition they belong in (:width wide, from
-- the Unix epoch): normally none. A sequential scan of the default partition, which holds
-- only what no partition covered when it was written.
SELECT date_bin(make_interval(secs => CAST(:width AS float8)), created_at,
                TIMESTAMPTZ '1970-01-01 00:00:00+00') AS lower,
       count(*) AS rows
FROM {default_partition}
GROUP BY 1
ORDER BY 1

-- name: create_partition
-- A new partition, empty, made outside the table and then attached (attach_partition):
-- ATTACH takes SHARE UPDATE EXCLUSIVE on the table, which no writer, claim or settle
-- waits for, where CREATE TABLE ... PARTITION OF would take ACCESS EXCLUSIVE.
CREATE TABLE {partition} (LIKE {outbox} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02,
          autovacuum_vacuum_insert_scale_factor = 0.05)

-- name: attach_partition
-- Also locks and scans the default partition: if a row for this range arrived there since
-- the caller looked, ATTACH fails (check_violation) and the caller moves it (move_rows).
-- The table's indexes and row trigger are made on the partition here.
ALTER TABLE {outbox} ATTACH PARTITION {partition} FOR VALUES FROM ({lower}) TO ({upper})

-- name: lock_writers
-- Attaching a partition whose range holds times writers write now (or moving rows): no
-- writer runs meanwhile. A writer routes its row by the partitions there were when its
-- statement began, after taking ROW EXCLUSIVE on the table; a partition attached while it
-- runs would make its row, routed to the default partition, break that partition's new
-- constraint, and the writer's transaction would fail. This lock waits for every open
-- transaction that used the table (rows they put in the default partition are committed,
-- and moved with the others), and holds back new ones until the attach has committed; they
-- then route by the new list. ACCESS EXCLUSIVE, not SHARE ROW EXCLUSIVE, for the lock
-- order: every other statement locks the table before its partitions, so with this lock
-- held nobody holds a lock on a partition, and the ATTACH's ACCESS EXCLUSIVE on the default
-- partition (and lock_default) waits for no one. Under SHARE ROW EXCLUSIVE a transaction
-- that had read the table (ACCESS SHARE on it and on the default partition: a purge's or
-- requeue's destinations_matching) and then wrote it (ROW EXCLUSIVE on the table) closed a
-- cycle with the ATTACH: a deadlock, broken only by lock_timeout or deadlock_timeout. A
-- transaction that read the table and asks to write it while this lock waits goes first
-- (PostgreSQL lets a waiter that already holds a conflicting lock through). A range wholly
-- ahead of now receives no row yet (created_at is the writer's transaction start), so it
-- is attached without this lock.
LOCK TABLE {outbox} IN ACCESS EXCLUSIVE MODE

-- name: lock_default
-- Moving rows out of the default partition: nobody reads or writes it meanwhile. A claim,
-- settle or renewal of a row being moved waits, then finds it in its new partition (the
-- relay names rows by destination and seq, which the move keeps, as every other column).
LOCK TABLE {default_partition} IN ACCESS EXCLUSIVE MODE

-- name: move_rows
-- The default partition's rows of one range -> the new partition (not yet attached), then
-- (delete_moved) gone from the default partition, in the transaction that attaches it.
-- Directly on the partitions: the table's DELETE guard (refuse_delete, migration 0001 of
-- this layout) is not involved.
INSERT INTO {partition} ({columns})
SELECT {columns} FROM {default_partition}
WHERE created_at >= {lower} AND created_at < {upper}

-- name: delete_moved
DELETE FROM {default_partition} WHERE created_at >= {lower} AND created_at < {upper}

-- name: drop_candidate
-- Whether a partition can go: it holds no unfinished row (PENDING, PROCESSING, FAILED) and
-- no finished row settled after its status's retention began (:published_before,
-- :abandoned_before: now minus each retention). Index probes only: the partial
-- ready index (empty once every row is finished) and the finished index.
SELECT NOT EXISTS (SELECT 1 FROM {partition}
                   WHERE status IN ('PENDING', 'FAILED', 'PROCESSING'))
       AS finished,
       NOT EXISTS (SELECT 1 FROM {partition}
                   WHERE status = 'PUBLISHED'
                     AND updated_at >= CAST(:published_before AS timestamptz))
       AND NOT EXISTS (SELECT 1 FROM {partition}
                       WHERE status = 'ABANDONED'
                         AND updated_at >= CAST(:abandoned_before AS timestamptz))
       AS expired

-- name: lock_table
-- Dropping a partition: DROP takes ACCESS EXCLUSIVE on the table anyway (queries planned
-- with the old list of partitions must not run on); taken first, so the check that
-- follows and the DROP see the same rows. Invariant: a claim, settle, renewal, requeue or
-- insert either committed before this lock was granted, and the check sees what it did,
-- or waits until the DROP has committed: then the partition is gone (a requeue of one of
-- its ABANDONED rows, past retention, changes nothing, as if the row had been deleted
-- first; an insert whose time fell in its range goes to the default partition). So a
-- partition holding an unfinished row, or a row younger than its retention, is never
-- dropped.
LOCK TABLE {outbox} IN ACCESS EXCLUSIVE MODE

-- name: drop_partition
DROP TABLE {partition}
