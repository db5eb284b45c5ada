-- Migration 0005: a claim never lets a key's later row go ahead of an earlier one that
-- SKIP LOCKED passed over.
-- SKIP LOCKED skips a committed PENDING row that a transaction outside outboxer holds (a
-- manual SELECT ... FOR UPDATE, say). The NOT EXISTS of 0004 looks only for rows in flight,
-- backing off or abandoned, so the key's next row was claimed ahead of the held one.
-- Rows committed while the claim runs cannot cause this here (unlike MySQL): the statement
-- reads one snapshot, and a key's rows commit in seq order (queries.sql: insert).
-- The body repeats 0004's claim with one more CTE: an applied migration never changes.

-- PENDING | FAILED (due) | PROCESSING (lock expired) -> PROCESSING, locked by this relay.
-- Invariants kept by the WHERE clauses, in addition to those written in 0004:
--  * a keyed row is claimed only if every unfinished row of its key before it is claimed in
--    this same batch. `passed_over` is every unfinished keyed row before the batch's last
--    row that the batch does not hold: a row held elsewhere, or one not due. A row not due
--    already blocks its key's later rows through the NOT EXISTS, so the new check only
--    drops rows behind a held one, and those wait for the next claim.
--  * one range scan of the ready index up to the batch's last seq finds them: the check
--    costs about one more pass over the rows the claim walked, not one probe per row.
CREATE OR REPLACE FUNCTION {schema}.{table_raw}_claim(
    p_destination text, p_relay_id text, p_limit integer, p_lock_seconds float8,
    p_abandoned_blocks boolean, p_lock_key bigint)
RETURNS TABLE (seq bigint, id uuid, destination text, topic text, key text, payload bytea,
               content_type text, headers text, attempts integer, created_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock_key);
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT o.ctid AS row_id, o.seq AS row_seq, o.key AS row_key
        FROM {outbox} AS o
        WHERE o.destination = p_destination
          AND o.status IN ('PENDING', 'FAILED', 'PROCESSING')
          AND CASE o.status WHEN 'PROCESSING' THEN o.locked_until < now()
                            ELSE o.next_attempt_at <= now() END
          AND (o.key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {outbox} AS b
                WHERE b.destination = o.destination
                  AND b.key = o.key
                  AND b.status IN ('PROCESSING', 'FAILED', 'ABANDONED')
                  AND b.seq < o.seq
                  AND CASE b.status WHEN 'PROCESSING' THEN b.locked_until >= now()
                                    WHEN 'FAILED' THEN b.next_attempt_at > now()
                                    ELSE CAST(p_abandoned_blocks AS boolean) END))
        ORDER BY o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ),
    passed_over AS MATERIALIZED (
        SELECT e.key AS row_key, min(e.seq) AS first_seq
        FROM {outbox} AS e
        WHERE e.destination = p_destination
          AND e.status IN ('PENDING', 'FAILED', 'PROCESSING')
          AND e.key IS NOT NULL
          AND e.seq < (SELECT max(d.row_seq) FROM due AS d)
          AND e.seq NOT IN (SELECT d.row_seq FROM due AS d)
        GROUP BY e.key
    )
    UPDATE {outbox} AS t
    SET status = 'PROCESSING',
        locked_by = p_relay_id,
        locked_until = now() + make_interval(secs => CAST(p_lock_seconds AS float8)),
        -- Taking over an expired lock: the previous attempt died with its relay, so it counts.
        attempts = t.attempts + CASE WHEN t.status = 'PROCESSING' THEN 1 ELSE 0 END,
        last_error = CASE WHEN t.status = 'PROCESSING'
                          THEN 'lock expired: relay ' || coalesce(t.locked_by, '?') || ' died or stalled'
                          ELSE t.last_error END,
        updated_at = now()
    FROM due
    WHERE t.ctid = due.row_id
      AND NOT EXISTS (SELECT 1 FROM passed_over AS p
                      WHERE p.row_key = due.row_key AND p.first_seq < due.row_seq)
    RETURNING t.seq, t.id, t.destination, t.topic, t.key, t.payload, t.content_type,
              CAST(t.headers AS text) AS headers, t.attempts, t.created_at;
END
$fn$;
