-- Checks `apply_schema` makes before it changes anything (MySQL commits DDL statement by
-- statement: a refusal after the first migration began would leave it half-applied).

-- name: table_columns
-- The columns of a table of the connection's database (:table, unquoted); no row if there is
-- no such table. apply_schema compares a table that a migration would adopt (CREATE TABLE
-- IF NOT EXISTS) with the columns it expects.
SELECT COLUMN_NAME AS name
FROM information_schema.COLUMNS
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :table
ORDER BY ORDINAL_POSITION
