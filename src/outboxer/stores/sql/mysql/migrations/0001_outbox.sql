-- Migration 0001: the outbox, its two lock tables and the inbox (MySQL 8.0.13+, MariaDB 10.6+).
-- Tokens in braces are replaced with backquoted names. There are no schemas here: every
-- table lives in the database of the URL.
--
-- MySQL commits each DDL statement on its own, so a migration cannot be rolled back half
-- way. Every statement can therefore run again: a run that stopped in the middle is
-- completed by the next `outboxer schema apply`, which records the version at the end.
--
-- All tables are InnoDB (row locks, SKIP LOCKED) in utf8mb4 with a binary collation, so
-- keys, topics, destinations and consumers compare byte for byte, as in PostgreSQL; the
-- default collations would make 'Order-1' and 'order-1' one key.

CREATE TABLE IF NOT EXISTS {outbox} (
    -- Publish order, and the clustered primary key, so rows are appended in seq order.
    -- AUTO_INCREMENT values are taken before commit, so across transactions seq is not
    -- commit order; for one key it is, because the writer first locks the key's lock row
    -- and holds it until commit (queries.sql, key_lock; since migration 0005 a slot row).
    seq             BIGINT NOT NULL AUTO_INCREMENT,
    -- The UUIDv7 as text: readable in any client and in hand-written SQL, the same value
    -- SQLite stores; its text sorts by time, so the unique index still grows at its end.
    -- BINARY(16) would save 20 bytes a row and cost a conversion everywhere it is used.
    id              CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    destination     VARCHAR(255) NOT NULL DEFAULT 'default',
    topic           VARCHAR(255) NOT NULL,
    `key`           VARCHAR(255) NULL,
    payload         LONGBLOB NOT NULL,
    content_type    VARCHAR(255) NOT NULL,
    headers         JSON NOT NULL DEFAULT ('{}'),
    status          VARCHAR(10) NOT NULL DEFAULT 'PENDING',
    attempts        INT NOT NULL DEFAULT 0,
    -- Times are UTC, always written from UTC_TIMESTAMP(6), whatever the session time zone.
    next_attempt_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    last_error      TEXT NULL,
    locked_by       VARCHAR(255) NULL,
    locked_until    DATETIME(6) NULL,
    created_at      DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    updated_at      DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    published_at    DATETIME(6) NULL,
    -- MySQL has no partial indexes. These two flags stand in for the WHERE clauses of
    -- PostgreSQL's: an index that starts (destination, flag) reaches the flagged rows
    -- without walking the published history that retention keeps.
    unfinished      TINYINT AS (status IN ('PENDING', 'FAILED', 'PROCESSING')) STORED,
    blocker         TINYINT AS (status IN ('PROCESSING', 'FAILED', 'ABANDONED')) STORED,
    PRIMARY KEY (seq),
    -- One copy of a message per destination; a caller-chosen id cannot be enqueued twice
    -- (error 1062 on this key is DuplicateMessageError).
    UNIQUE KEY id_destination (id, destination),
    -- The claim walks unfinished rows of one destination in publish order.
    KEY ready_idx (destination, unfinished, seq),
    -- The rows that can hold back later rows of their key: in flight, backing off, or
    -- abandoned (when abandoned rows block). The claim probes it once per keyed candidate.
    KEY blocking_idx (destination, blocker, `key`, seq),
    -- Retention deletes finished rows oldest first, per status.
    KEY finished_idx (status, updated_at),
    CONSTRAINT status_check
        CHECK (status IN ('PENDING', 'PROCESSING', 'PUBLISHED', 'FAILED', 'ABANDONED'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- One row per destination: the destination lock. A claim holds its destination's row
-- exclusively (SELECT ... FOR UPDATE) until it commits; settles and requeues hold it shared
-- (LOCK IN SHARE MODE). So claims of one destination run one at a time, and a claim never
-- sees a row half-way through another relay's claim or settle, which SKIP LOCKED alone
-- cannot promise: it would skip such a row and could claim the row behind it, same key.
-- A row lock, because MySQL's GET_LOCK is held by the session, not the transaction, and
-- has no shared mode. The first lock of a destination inserts its row.
CREATE TABLE IF NOT EXISTS {destinations} (
    destination VARCHAR(255) NOT NULL,
    PRIMARY KEY (destination)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- One row per key being written: the key lock of the write path until migration 0005,
-- which replaced it with fixed slot rows (a row inserted on first use and deleted when
-- unheld let two writers of one key deadlock on the gap it left).
CREATE TABLE IF NOT EXISTS {keys} (
    `key` VARCHAR(255) NOT NULL,
    PRIMARY KEY (`key`)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The inbox. A consumer records each message id it applied, in the same transaction as
-- its own writes, so a redelivered message is recognised and skipped. One per database.
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer    VARCHAR(255) NOT NULL,
    message_id  CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    received_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, message_id),
    -- Retention deletes old entries oldest first.
    KEY received_idx (received_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
