-- Migration 0006 of the partitioned layout: leases, as migrations/0006_leases.sql (which
-- says why and holds the invariants of each step), on a table whose rows live in several
-- partitions. Three differences, the statements and their invariants otherwise the same:
-- * a row is named by (created_at, tableoid, ctid) where the default table's functions
--   name it by ctid alone. A ctid names a row only within its partition: matched alone,
--   the UPDATE would also change the rows at that place in every other partition.
--   tableoid makes the name exact, and created_at, the partition key, lets the executor
--   skip every other partition (run-time pruning) instead of probing each;
-- * step 3 reads the rows that block a key once per claim, not once per candidate row
--   (the comment there says why and what it keeps);
-- * settle and renew run on generic plans (their comment says why). They find their rows
--   by (destination, seq), as in the default table: one probe of a small partial index
--   per partition.

ALTER TABLE {outbox} ADD COLUMN lease uuid;

-- Rows in flight by lease expiry: every claim looks for expired leases first. Partial, so
-- it holds the rows in flight (a few batches), whatever the backlog or the history.
-- Built inside the schema transaction: writers wait for one pass over the table.
CREATE INDEX {table_raw}_leased_idx ON {outbox} (destination, locked_until)
    WHERE status = 'PROCESSING';

-- One claim, in three steps; each statement sees what the steps before it changed (a
-- VOLATILE function takes a fresh snapshot per statement). Returns the rows it took
-- (`taken`: 'claimed' or 'recovered'), the rows it abandoned ('abandoned'), or, when a row
-- waits to be recovered and p_recover is false, one row that says so ('recovery_waiting',
-- every other column NULL) and nothing else.
CREATE FUNCTION {schema}.{table_raw}_claim(
    p_destination text, p_relay_id text, p_lease uuid, p_limit integer,
    p_lock_seconds float8, p_abandoned_blocks boolean, p_max_attempts integer,
    p_recover boolean, p_lock_key bigint)
RETURNS TABLE (seq bigint, id uuid, destination text, topic text, key text, payload bytea,
               content_type text, headers text, attempts integer, created_at timestamptz,
               taken text, last_error text)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    candidate record;
    expired_row tid;
    expired_table oid;
    expired_created timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock_key);

    -- 1. PROCESSING, lease expired, attempts used up -> ABANDONED. Invariants:
    --  * the lease expired: its relay died or stalled while publishing the row, and that
    --    attempt counts (attempts + 1), as a takeover always counted it;
    --  * with it, max_attempts attempts were made: the row is given up as a failed publish
    --    at its last attempt is (settle), instead of being taken over for ever;
    --  * the rest of its key follows abandoned_blocks: steps 2 and 3 see it ABANDONED.
    RETURN QUERY
    WITH exhausted AS MATERIALIZED (
        SELECT o.created_at AS row_created, o.tableoid AS row_table, o.ctid AS row_id
        FROM {outbox} AS o
        WHERE o.destination = p_destination
          AND o.status = 'PROCESSING'
          AND o.locked_until < now()
          AND o.attempts + 1 >= p_max_attempts
        ORDER BY o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE {outbox} AS t
    SET status = 'ABANDONED',
        attempts = t.attempts + 1,
        last_error = 'abandoned after ' || (t.attempts + 1) || ' attempts: relay '
                     || coalesce(t.locked_by, '?')
                     || ' died or stalled while publishing this message (its lease expired)',
        locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = now()
    FROM exhausted
    WHERE t.created_at = exhausted.row_created AND t.tableoid = exhausted.row_table
      AND t.ctid = exhausted.row_id
    RETURNING t.seq, t.id, t.destination, t.topic, t.key, t.payload, t.content_type,
              CAST(t.headers AS text) AS headers, t.attempts, t.created_at,
              CAST('abandoned' AS text) AS taken, t.last_error;

    -- 2. PROCESSING, lease expired -> PROCESSING under this claim's lease, ALONE: the
    --    earliest such row that heads its key. Invariants:
    --  * alone: if this message is what kills its relay, it dies alone; its batch-mates are
    --    taken over by later claims, one each, and published. The relay asks for it
    --    (p_recover) only while it holds no other row, and holds no other until it is
    --    settled (relay.RecoveryGate): a claim that may not recover, and finds such a row,
    --    takes nothing else and says so, and its relay drains before it claims again;
    --  * it heads its key: no earlier row of its key is in flight or failed (due or not:
    --    it goes first), nor abandoned when abandoned rows block. Taken in seq order, a
    --    key's recovered rows keep their order. No PENDING row of a key comes before a
    --    row in flight: a claim takes a key's rows in seq order with every unfinished row
    --    before them, and a settle records its whole batch (the relay keeps this when the
    --    database refuses a row: it then leaves that row's earlier rows in flight too). So
    --    the probe needs only the rows of blocking_idx, as step 3's does;
    --  * the attempt that died counts (step 1 kept attempts + 1 below max_attempts) and
    --    last_error names the relay that held the row.
    -- The rows whose lease expired are walked in seq order and probed one by one: the first
    -- one usually heads its key, so a claim probes one row, however many wait.
    FOR candidate IN
        SELECT o.created_at AS row_created, o.tableoid AS row_table, o.ctid AS row_id,
               o.seq AS row_seq, o.key AS row_key
        FROM {outbox} AS o
        WHERE o.destination = p_destination
          AND o.status = 'PROCESSING'
          AND o.locked_until < now()
        ORDER BY o.seq
    LOOP
        -- Two probes, one per partial index of blocking rows (migration 0001 of this layout).
        CONTINUE WHEN candidate.row_key IS NOT NULL AND (
            EXISTS (SELECT 1 FROM {outbox} AS b
                    WHERE b.destination = p_destination
                      AND b.key = candidate.row_key
                      AND b.status IN ('PROCESSING', 'FAILED')
                      AND b.seq < candidate.row_seq)
            OR (p_abandoned_blocks AND EXISTS (
                    SELECT 1 FROM {outbox} AS b
                    WHERE b.destination = p_destination
                      AND b.key = candidate.row_key
                      AND b.status = 'ABANDONED'
                      AND b.seq < candidate.row_seq)));
        -- Locked as the row is now (a renewal since the walk began moved it: passed over).
        SELECT t.ctid, t.tableoid, t.created_at INTO expired_row, expired_table, expired_created
        FROM {outbox} AS t
        WHERE t.created_at = candidate.row_created AND t.tableoid = candidate.row_table
          AND t.ctid = candidate.row_id AND t.status = 'PROCESSING' AND t.locked_until < now()
        FOR UPDATE SKIP LOCKED;
        EXIT WHEN expired_row IS NOT NULL;
    END LOOP;
    IF expired_row IS NOT NULL AND NOT p_recover THEN
        taken := 'recovery_waiting';
        RETURN NEXT;
        RETURN;
    END IF;
    IF expired_row IS NOT NULL THEN
        RETURN QUERY
        UPDATE {outbox} AS t
        SET locked_by = p_relay_id,
            lease = p_lease,
            locked_until = now() + make_interval(secs => p_lock_seconds),
            attempts = t.attempts + 1,
            last_error = 'relay ' || coalesce(t.locked_by, '?')
                         || ' died or stalled while publishing this message (its lease expired)',
            updated_at = now()
        WHERE t.created_at = expired_created AND t.tableoid = expired_table
          AND t.ctid = expired_row
        RETURNING t.seq, t.id, t.destination, t.topic, t.key, t.payload, t.content_type,
                  CAST(t.headers AS text) AS headers, t.attempts, t.created_at,
                  CAST('recovered' AS text) AS taken, t.last_error;
        RETURN;
    END IF;

    -- 3. PENDING | FAILED (due) -> PROCESSING under this claim's lease: the claim of 0005,
    --    its invariants kept, with two more:
    --  * a row in flight is never taken here, even once its lease expired: step 2 takes
    --    such a row, alone;
    --  * a row in flight holds back its key's later rows even once its lease expired: they
    --    wait until it is recovered and settled, so none overtakes it.
    -- The default table probes each candidate's key for a blocking row; here that probe
    -- would visit every partition, once per candidate. `blockers` reads the rows in flight
    -- or backing off once instead (one scan of each partition's small blocking index), and
    -- keeps each key's earliest: a key's candidate is blocked by an earlier such row iff
    -- that row's seq is below the candidate's. ABANDONED rows, which can be many, are
    -- probed per candidate as before, and only when they block (p_abandoned_blocks).
    RETURN QUERY
    WITH blockers AS MATERIALIZED (
        SELECT b.key AS row_key, min(b.seq) AS first_seq
        FROM {outbox} AS b
        WHERE b.destination = p_destination
          AND b.key IS NOT NULL
          AND b.status IN ('PROCESSING', 'FAILED')
          AND (b.status = 'PROCESSING' OR b.next_attempt_at > now())
        GROUP BY b.key
    ),
    due AS MATERIALIZED (
        SELECT o.created_at AS row_created, o.tableoid AS row_table, o.ctid AS row_id,
               o.seq AS row_seq, o.key AS row_key
        FROM {outbox} AS o
        WHERE o.destination = p_destination
          AND o.status IN ('PENDING', 'FAILED')
          AND o.next_attempt_at <= now()
          AND (o.key IS NULL OR (
                NOT EXISTS (SELECT 1 FROM blockers AS k
                            WHERE k.row_key = o.key AND k.first_seq < o.seq)
                AND (NOT p_abandoned_blocks OR NOT EXISTS (
                        SELECT 1 FROM {outbox} AS b
                        WHERE b.destination = o.destination
                          AND b.key = o.key
                          AND b.status = 'ABANDONED'
                          AND b.seq < o.seq))))
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
        lease = p_lease,
        locked_until = now() + make_interval(secs => p_lock_seconds),
        updated_at = now()
    FROM due
    WHERE t.created_at = due.row_created AND t.tableoid = due.row_table
      AND t.ctid = due.row_id
      AND NOT EXISTS (SELECT 1 FROM passed_over AS p
                      WHERE p.row_key = due.row_key AND p.first_seq < due.row_seq)
    RETURNING t.seq, t.id, t.destination, t.topic, t.key, t.payload, t.content_type,
              CAST(t.headers AS text) AS headers, t.attempts, t.created_at,
              CAST('claimed' AS text) AS taken, t.last_error;
END
$fn$;

-- Settles one claimed batch: every outcome in one transaction, under the shared destination
-- lock (see 0004). Each UPDATE changes a row only while it is PROCESSING under this
-- claim's lease (p_lease, and p_relay_id against relays that write no lease): a holder
-- whose lease expired and was taken over changes nothing, its copy was a duplicate and the
-- new holder decides. A settled row holds no lease. Returns how many rows each UPDATE
-- changed; fewer than asked were taken over.
CREATE FUNCTION {schema}.{table_raw}_settle(
    p_destination text, p_relay_id text, p_lease uuid, p_lock_key bigint,
    p_max_attempts integer, p_published bigint[], p_failed bigint[], p_errors text[],
    p_delays float8[], p_permanent boolean[], p_released bigint[],
    OUT n_published integer, OUT n_failed integer, OUT n_released integer)
LANGUAGE plpgsql VOLATILE
-- Planned over every partition at each call otherwise. Each UPDATE finds its rows by
-- (destination, seq) whatever the values, so plans made once serve. (Not the claim: its
-- step 3's plan depends on the backlog; a generic one took ten times as long with
-- 200,000 rows due.)
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock_shared(p_lock_key);
    n_published := 0;
    n_failed := 0;
    n_released := 0;
    IF cardinality(p_published) > 0 THEN
        -- PROCESSING -> PUBLISHED, by the lease holder.
        UPDATE {outbox}
        SET status = 'PUBLISHED', published_at = now(), updated_at = now(),
            locked_by = NULL, locked_until = NULL, lease = NULL
        WHERE destination = p_destination AND seq = ANY(p_published)
          AND status = 'PROCESSING' AND lease = p_lease AND locked_by = p_relay_id;
        GET DIAGNOSTICS n_published = ROW_COUNT;
    END IF;
    IF cardinality(p_failed) > 0 THEN
        -- PROCESSING -> FAILED (attempts + 1, due again after its backoff), or -> ABANDONED
        -- when the failure is permanent or the attempts are used up. By the lease holder.
        UPDATE {outbox} AS t
        SET attempts = t.attempts + 1,
            last_error = f.error,
            status = CASE WHEN f.permanent OR t.attempts + 1 >= p_max_attempts
                          THEN 'ABANDONED' ELSE 'FAILED' END,
            next_attempt_at = now() + make_interval(secs => f.delay),
            locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = now()
        FROM unnest(p_failed, p_errors, p_delays, p_permanent) AS f(seq, error, delay, permanent)
        WHERE t.destination = p_destination AND t.seq = f.seq
          AND t.status = 'PROCESSING' AND t.lease = p_lease AND t.locked_by = p_relay_id;
        GET DIAGNOSTICS n_failed = ROW_COUNT;
    END IF;
    IF cardinality(p_released) > 0 THEN
        -- PROCESSING -> claimable again without counting an attempt (not tried, or its
        -- lease ran out mid-publish: shutdown, an earlier message of its key failed, the
        -- database unreachable). By the lease holder.
        UPDATE {outbox}
        SET status = CASE WHEN attempts > 0 THEN 'FAILED' ELSE 'PENDING' END,
            next_attempt_at = now(), locked_by = NULL, locked_until = NULL, lease = NULL,
            updated_at = now()
        WHERE destination = p_destination AND seq = ANY(p_released)
          AND status = 'PROCESSING' AND lease = p_lease AND locked_by = p_relay_id;
        GET DIAGNOSTICS n_released = ROW_COUNT;
    END IF;
END
$fn$;

-- Renews the lease of rows still being published: PROCESSING under this claim's lease ->
-- locked until p_lock_seconds from now. Returns how many rows it renewed; fewer than asked
-- were taken over (the holder stalled past its lease), and the relay stops publishing them.
-- Invariants:
--  * only the lease holder extends a row (lease and locked_by as in settle): a stale holder
--    never takes back a row another claim holds. A holder whose lease ran out but that
--    nobody took over yet may extend it: nobody else has published the row since;
--  * no destination lock: a renewal changes no status and lets no key's row overtake
--    another. A claim that read the row as expired before the renewal committed locks it
--    (FOR UPDATE), rechecks the row and passes it over; one that locked it first changed
--    the lease, and the renewal then matches nothing;
--  * durable (synchronous_commit on, unlike the relay's other commits): a renewal lost in a
--    crash would let another relay take over rows this one still publishes.
CREATE FUNCTION {schema}.{table_raw}_renew(
    p_destination text, p_relay_id text, p_lease uuid, p_seqs bigint[],
    p_lock_seconds float8, OUT n_renewed integer)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan  -- as the settle's
AS $fn$
BEGIN
    PERFORM set_config('synchronous_commit', 'on', true);
    UPDATE {outbox}
    SET locked_until = now() + make_interval(secs => p_lock_seconds)
    WHERE destination = p_destination AND seq = ANY(p_seqs)
      AND status = 'PROCESSING' AND lease = p_lease AND locked_by = p_relay_id;
    GET DIAGNOSTICS n_renewed = ROW_COUNT;
END
$fn$;
