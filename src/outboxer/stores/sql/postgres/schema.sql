-- Checks `apply_schema` and `migrate-partitioned` make before they change anything.

-- name: table_columns
-- The columns of a table (:table, schema-qualified and quoted as in the tokens); no row if
-- there is no such table. apply_schema compares a table that a migration would adopt
-- (CREATE TABLE IF NOT EXISTS: the inbox, the dead letters) with the columns it expects.
SELECT a.attname AS name
FROM pg_attribute AS a
WHERE a.attrelid = to_regclass(:table) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum

-- name: same_name_but_case
-- Relations of the schema whose names equal the outbox's, or those of its tables, but for
-- case ("Outbox" against outbox). The migrations name indexes, constraints and functions
-- after the table unquoted, so PostgreSQL folds them to lower case: two such outboxes would
-- share those names (and one's claim function replace the other's).
SELECT c.relname AS name
FROM pg_class AS c
WHERE c.relnamespace = to_regnamespace(:schema)
  AND c.relkind IN ('r', 'p')
  AND lower(c.relname) IN (lower(:table), lower(:table) || '_migrations')
  AND c.relname NOT IN (:table, :table || '_migrations')
ORDER BY c.relname
