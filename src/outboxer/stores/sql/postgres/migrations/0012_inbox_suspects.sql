-- Migration 0012: suspects of the consumer runner (outboxer.Consumer). A message the broker
-- delivers again (its redelivered flag) may be one whose handler killed the consumer's
-- process (a segfault, the OOM killer, os._exit): an in-process failure count dies with the
-- process, so such a message would be delivered, and kill the consumer, for ever. Before a
-- redelivered message's handler runs, its attempt is recorded here in a transaction of its
-- own; the transaction that applies it deletes the row. A row that is still here when the
-- message comes again stands for an attempt that never ended: a death.
-- One table per schema, shared by every consumer group (column consumer), like the inbox.

CREATE TABLE IF NOT EXISTS {inbox_suspects} (
    consumer    text NOT NULL,
    message_id  uuid NOT NULL,
    -- Recorded attempts that never ended (0 while the first recorded attempt runs).
    deaths      integer NOT NULL DEFAULT 0,
    first_seen  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
