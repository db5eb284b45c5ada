-- Debezium layout queries.

-- name: insert
-- Runs on the caller's connection, in the caller's transaction; Debezium reads the row
-- from the WAL once it commits, in commit order.
INSERT INTO {debezium} (id, aggregatetype, aggregateid, type, payload, headers)
VALUES (CAST(:id AS uuid), :aggregatetype, :aggregateid, :type, CAST(:payload AS jsonb),
        CAST(:headers AS jsonb))

-- name: cleanup
-- Retention: Debezium has read the rows long before; its router skips the deletes.
DELETE FROM {debezium}
WHERE id IN (SELECT id FROM {debezium} WHERE created_at < now() - make_interval(secs => :retention)
             ORDER BY created_at LIMIT :limit)
