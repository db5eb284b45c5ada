-- `outboxer schema migrate-partitioned`: the default table -> the partitioned layout, in
-- one transaction (PostgresStore.migrate_to_partitioned runs these blocks in order, with
-- the partitioned layout's migrations between them). Tokens in braces are names; {plain}
-- is the default table under its new name, kept with its history.
--
-- Invariants:
--  * all or nothing: the transaction commits the new table with every unfinished row of
--    the old one, or changes nothing;
--  * writers wait, then go on: they wait for the lock on the old table; when the
--    transaction commits, their statement looks the name up again and writes to the new
--    table. A row committed before the lock was granted is in the old table, and moved
--    (the transaction is READ COMMITTED whatever the database's default: a snapshot taken
--    before the lock, at REPEATABLE READ, would not see it);
--  * seq goes on: the new table's sequence continues where the old one stopped, so a key's
--    rows written after the move sort after its rows written before it;
--  * no relay runs: its claim function, running when the names change, would go on with
--    the old function's statements on the new table (the command checks, after the lock
--    and again just before it commits: relays_connected).

-- name: relays_connected
-- Sessions of outboxer relays (and of `serve`, status and the other commands that use the
-- relay's pool) on this database, other than this one.
SELECT count(*) AS sessions
FROM pg_stat_activity
WHERE datname = current_database()
  AND pid <> pg_backend_pid()
  AND application_name LIKE 'outboxer-relay%'

-- name: lock_plain
-- Every writer, claim and settle waits from here to the commit.
LOCK TABLE {outbox} IN ACCESS EXCLUSIVE MODE

-- name: plain_sequence
SELECT pg_get_serial_sequence(:outbox, 'seq') AS name

-- name: rename_plain
-- The old table and the names of its primary key and sequence move aside, freeing theirs
-- for the new table (its other indexes: plain_indexes). Its notify trigger goes: nothing writes to it any more.
-- The new name quoted, as {plain} names it after: unquoted, an upper-case one was folded.
ALTER TABLE {outbox} RENAME TO {plain_name};
ALTER TABLE {plain} RENAME CONSTRAINT {table_raw}_pkey TO {plain_raw}_pkey;
ALTER SEQUENCE {plain_sequence} RENAME TO {plain_raw}_seq_seq;
DROP TRIGGER {table_raw}_notify ON {plain};
-- The listeners' registrations: remade by the partitioned layout's migration 0003 (a
-- relay registers again when it next waits).
DROP TABLE {listeners}

-- name: plain_indexes
-- The old table's other indexes (every migration's: 0001's, 0006's, 0008's, later ones'),
-- renamed by the caller from <table>_... to <table>_plain_..., freeing the names the
-- partitioned layout's migrations give their own.
SELECT c.relname AS name
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass(:plain) AND NOT i.indisprimary

-- name: old_functions
-- The default table's functions, every overload (0004's, 0006's): the partitioned layout
-- makes its own under the same names.
SELECT CAST(CAST(p.oid AS regprocedure) AS text) AS signature
FROM pg_proc AS p
WHERE p.pronamespace = CAST(:schema AS regnamespace)
  AND p.proname IN (:claim, :settle, :renew, :notify)

-- name: move_unfinished
-- PENDING, PROCESSING, FAILED and ABANDONED rows -> the new table, every column kept (seq,
-- lease and created_at too): a relay's lease, a key's order and a row's age go on as they
-- were. PUBLISHED rows stay in {plain}, history only.
INSERT INTO {outbox} ({columns}) OVERRIDING SYSTEM VALUE
SELECT {columns} FROM {plain}
WHERE status IN ('PENDING', 'PROCESSING', 'FAILED', 'ABANDONED')

-- name: continue_sequence
SELECT setval(pg_get_serial_sequence(:outbox, 'seq'), s.last_value, s.is_called)
FROM {schema}.{plain_raw}_seq_seq AS s

-- name: forget_migrations
DELETE FROM {migrations}

-- name: comment_plain
COMMENT ON TABLE {plain} IS 'outboxer: the outbox table before it was partitioned; its unfinished rows were copied into the partitioned one. History only: drop it once past retention.'

-- name: table_columns
-- The new table's columns: move_unfinished copies these.
SELECT a.attname AS name
FROM pg_attribute AS a
WHERE a.attrelid = to_regclass(:table) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum

-- name: user_columns
-- The old table's columns with their types, compared by the caller with the new table's:
-- one the partitioned layout lacks was added by a user, and the move refuses to lose it.
SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type
FROM pg_attribute AS a
WHERE a.attrelid = to_regclass(:plain) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
