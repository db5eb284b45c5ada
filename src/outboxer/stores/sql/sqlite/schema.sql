-- Checks `apply_schema` makes before it changes anything.

-- name: table_columns
-- The columns of a table (:table, unquoted; SQLite matches names without regard to case);
-- no row if there is no such table. apply_schema compares a table that a migration would
-- adopt (CREATE TABLE IF NOT EXISTS) with the columns it expects.
SELECT name FROM pragma_table_info(:table)
