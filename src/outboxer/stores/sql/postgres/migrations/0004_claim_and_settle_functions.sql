-- Migration 0004: claim and settle as functions, one round trip each.
-- A relay that claims and settles small batches (writes trickling in) spent most of its
-- time on round trips: BEGIN, the destination lock, the statement, COMMIT. A function call
-- in autocommit is one. VOLATILE functions take a fresh snapshot for each statement they
-- run, so the UPDATE after the lock sees every claim and settle committed before the lock
-- was granted, exactly as the separate statements did. A single statement taking the
-- lock in a CTE would not: its snapshot predates the wait.

-- The destination lock (p_lock_key). Claims of one destination run one at a time; settles
-- take the same lock shared. Together this means a claim never sees a row half-way through
-- another relay's claim or settle, which SKIP LOCKED alone cannot promise: it would skip
-- such a row and could claim the row behind it, same key.

-- PENDING | FAILED (due) | PROCESSING (lock expired) -> PROCESSING, locked by this relay.
-- Invariants kept by the WHERE clause:
--  * a row is due: its next attempt has come, or its relay's lock expired (that relay died);
--  * a keyed row is claimed only when no earlier row of its key blocks it: in flight
--    elsewhere, backing off, or abandoned when abandoned rows block. Earlier rows that are
--    due themselves come first in seq order, so they are in this same batch, ahead of it;
--  * no uncommitted row of the key can have a smaller seq than a committed one: the insert
--    holds the key's lock until commit before it takes its seq (queries.sql: insert). So a row
--    committed late can never be overtaken: it sorts after everything visible here.
CREATE FUNCTION {schema}.{table_raw}_claim(
    p_destination text, p_relay_id text, p_limit integer, p_lock_seconds float8,
    p_abandoned_blocks boolean, p_lock_key bigint)
RETURNS TABLE (seq bigint, id uuid, destination text, topic text, key text, payload bytea,
               content_type text, headers text, attempts integer, created_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock_key);
    RETURN QUERY
    WITH due AS (
        SELECT o.ctid
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
    WHERE t.ctid = due.ctid
    RETURNING t.seq, t.id, t.destination, t.topic, t.key, t.payload, t.content_type,
              CAST(t.headers AS text) AS headers, t.attempts, t.created_at;
END
$fn$;

-- Settles one claimed batch: every outcome in one transaction, under the shared lock.
-- Returns how many rows each UPDATE changed; fewer than asked means this relay's lock
-- expired and another relay took those rows over.
CREATE FUNCTION {schema}.{table_raw}_settle(
    p_destination text, p_relay_id text, p_lock_key bigint, p_max_attempts integer,
    p_published bigint[], p_failed bigint[], p_errors text[], p_delays float8[],
    p_permanent boolean[], p_released bigint[],
    OUT n_published integer, OUT n_failed integer, OUT n_released integer)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock_shared(p_lock_key);
    n_published := 0;
    n_failed := 0;
    n_released := 0;
    IF cardinality(p_published) > 0 THEN
        -- PROCESSING -> PUBLISHED, only by the relay holding the lock: a relay whose expired lock
        -- was taken over changes nothing (its copy was a duplicate; the new owner decides).
        UPDATE {outbox}
        SET status = 'PUBLISHED', published_at = now(), updated_at = now(),
            locked_by = NULL, locked_until = NULL
        WHERE destination = p_destination AND seq = ANY(p_published)
          AND status = 'PROCESSING' AND locked_by = p_relay_id;
        GET DIAGNOSTICS n_published = ROW_COUNT;
    END IF;
    IF cardinality(p_failed) > 0 THEN
        -- PROCESSING -> FAILED (attempts + 1, due again after its backoff), or -> ABANDONED when the
        -- failure is permanent or the attempts are used up. Only by the relay holding the lock.
        UPDATE {outbox} AS t
        SET attempts = t.attempts + 1,
            last_error = f.error,
            status = CASE WHEN f.permanent OR t.attempts + 1 >= p_max_attempts
                          THEN 'ABANDONED' ELSE 'FAILED' END,
            next_attempt_at = now() + make_interval(secs => f.delay),
            locked_by = NULL, locked_until = NULL, updated_at = now()
        FROM unnest(p_failed, p_errors, p_delays, p_permanent) AS f(seq, error, delay, permanent)
        WHERE t.destination = p_destination AND t.seq = f.seq
          AND t.status = 'PROCESSING' AND t.locked_by = p_relay_id;
        GET DIAGNOSTICS n_failed = ROW_COUNT;
    END IF;
    IF cardinality(p_released) > 0 THEN
        -- PROCESSING -> claimable again without counting an attempt (never tried: shutdown, or an
        -- earlier message of its key failed). Only by the relay holding the lock.
        UPDATE {outbox}
        SET status = CASE WHEN attempts > 0 THEN 'FAILED' ELSE 'PENDING' END,
            next_attempt_at = now(), locked_by = NULL, locked_until = NULL, updated_at = now()
        WHERE destination = p_destination AND seq = ANY(p_released)
          AND status = 'PROCESSING' AND locked_by = p_relay_id;
        GET DIAGNOSTICS n_released = ROW_COUNT;
    END IF;
END
$fn$;
