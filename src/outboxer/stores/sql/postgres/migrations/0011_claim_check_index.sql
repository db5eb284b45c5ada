-- Migration 0011: the claim-check sweep finds the rows of its objects through an index.
-- The sweep (payload.sql: referenced, a page of up to 1,000 object names at a time) asked
-- headers->>'outboxer-claim-check' = ANY(...) of a table without any index on it: one
-- sequential scan of the whole table, history included, per page of objects, at every
-- cleanup. This partial expression index holds the claim-checked rows only, so writers
-- of rows without a claim-check pay nothing. Its condition is the one referenced repeats
-- (headers ? 'outboxer-claim-check'): PostgreSQL keeps no statistics of a partial index's
-- expression, and without that condition it estimates a page of names to match most of
-- the table and scans it all. On the partitioned layout the index is made on each
-- partition, present and to come. Built inside the schema transaction: writers wait for
-- one pass over the table.
CREATE INDEX {table_raw}_claim_check_idx ON {outbox} ((headers->>'outboxer-claim-check'))
    WHERE headers ? 'outboxer-claim-check';
