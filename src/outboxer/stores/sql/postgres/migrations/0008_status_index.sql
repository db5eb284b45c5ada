-- Migration 0008: status, /status, /metrics and the message lists stay cheap on a big table.
-- Retention keeps days of PUBLISHED rows (millions), and a GROUP BY over all of them took
-- seconds, every few seconds, for every scraper. Every row that status counts exactly, and
-- every row an operator lists by status, is here: the unfinished ones, the ABANDONED, and
-- the PUBLISHED that needed more than one attempt (for the retry rate). A PUBLISHED row
-- published at its first attempt, nearly every row of a big table, is not: status
-- estimates those (queries.sql: status_stats) and lists them through finished_idx.
--  * counts_tally reads it alone (index-only: destination, attempts and created_at are
--    included), in time proportional to the backlog and the abandoned rows, not the history;
--  * list walks it backwards per status, newest change first (status, updated_at, seq),
--    and stops after the rows asked for.
-- Writers pay one more entry per unfinished row version (insert, claim, failure), none for
-- the PUBLISHED rows of a first attempt. Built inside the schema transaction: writers wait
-- for one pass over the table.
CREATE INDEX {table_raw}_status_idx ON {outbox} (status, updated_at, seq)
    INCLUDE (destination, attempts, created_at)
    WHERE status <> 'PUBLISHED' OR attempts > 0;
