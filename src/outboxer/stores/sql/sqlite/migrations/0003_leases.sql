-- Migration 0003: leases, renewed while a batch is in flight and fenced by a token; rows
-- of a relay that died are recovered one at a time (see the PostgreSQL migration 0006).
-- `lease`: the token of the claim that holds the row; settles and renewals match it.

ALTER TABLE {outbox} ADD COLUMN lease TEXT;

-- Rows in flight by lease expiry: every claim looks for expired leases first.
CREATE INDEX {table_raw}_leased_idx ON {outbox} (destination, locked_until)
    WHERE status = 'PROCESSING';
