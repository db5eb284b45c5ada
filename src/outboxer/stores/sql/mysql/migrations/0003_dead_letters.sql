-- Migration 0003: dead letters of the consumer runner (see the PostgreSQL migration 0007).
-- Every statement can run again (MySQL commits DDL statement by statement).

CREATE TABLE IF NOT EXISTS {dead_letters} (
    seq          BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer     VARCHAR(255) NOT NULL,
    message_id   CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    topic        VARCHAR(255) NOT NULL,
    `key`        VARCHAR(255) NULL,
    headers      JSON NOT NULL DEFAULT ('{}'),
    content_type VARCHAR(255) NOT NULL,
    payload      LONGBLOB NOT NULL,
    created_at   DATETIME(6) NULL,
    error        TEXT NOT NULL,
    attempts     INT NOT NULL,
    held         BOOLEAN NOT NULL DEFAULT FALSE,
    failed_at    DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    UNIQUE KEY consumer_message (consumer, message_id),
    KEY key_idx (consumer, `key`, seq)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
