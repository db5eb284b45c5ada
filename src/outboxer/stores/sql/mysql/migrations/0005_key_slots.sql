-- Migration 0005: the write path's key lock becomes a fixed table of 65536 slot rows.
-- A writer locks the slot of each of its keys (queries.sql, key_lock: slot = CRC32 of the
-- key's UTF-8 bytes & 65535). The rows are made here and never inserted or deleted after,
-- so locking them takes record locks only: no gap locks, hence no deadlock between two
-- writers of a key whose lock row was rolled back or deleted under them, which the lock
-- row per key of migration 0001 ({keys}) allowed.
--
-- {keys} stays, unused by this version: writers of an earlier version, still running
-- during a rolling upgrade, insert into it, and would fail if it were gone. Once none is
-- left, it can be dropped by hand (DROP TABLE <table>_keys). Until every writer runs this
-- version, an earlier one and a later one writing the same key do not wait for each other:
-- upgrade the writers of one key together if its order matters within that window.
CREATE TABLE IF NOT EXISTS {key_slots} (
    slot INT NOT NULL,
    PRIMARY KEY (slot)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- 16^4 slots from the hex digits, in one statement: all or none, so a table that has rows
-- has them all, and a migration run again adds nothing. (A recursive CTE would pass
-- MySQL's cte_max_recursion_depth, 1000 by default.)
INSERT INTO {key_slots} (slot)
WITH digits AS (
    SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL
    SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL
    SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL
    SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15)
SELECT d0.n + 16 * d1.n + 256 * d2.n + 4096 * d3.n
FROM digits AS d0 CROSS JOIN digits AS d1 CROSS JOIN digits AS d2 CROSS JOIN digits AS d3
WHERE NOT EXISTS (SELECT 1 FROM {key_slots});
