-- Migration 0006: the claim's test "does an earlier row of this key hold it back?" reads an
-- index of the key's unfinished rows. It counts PENDING rows not yet due among the blockers
-- since the claim stopped trusting every relay's clock, which no index covered: SQLite fell
-- back to scanning every earlier row of the table for each candidate, and a claim on a
-- large table held the write lock for seconds (writers failed with "database is locked").
-- SQLite uses a partial index only when the query repeats its condition word for word
-- (queries.sql: claim).

CREATE INDEX IF NOT EXISTS {table_raw}_waiting_idx ON {outbox} (destination, key, seq)
    WHERE key IS NOT NULL AND status IN ('PROCESSING', 'PENDING', 'FAILED', 'ABANDONED');
