-- Migration 0006: suspects of the consumer runner (see the PostgreSQL migration 0012).
-- Every statement can run again (MySQL commits DDL statement by statement).

CREATE TABLE IF NOT EXISTS {inbox_suspects} (
    consumer    VARCHAR(255) NOT NULL,
    message_id  CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    deaths      INT NOT NULL DEFAULT 0,
    first_seen  DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, message_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
