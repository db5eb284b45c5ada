-- Migration 0014: a claim never waits for a row lock, so it is never part of a deadlock.
-- Step 1b (a dead relay's rows behind an ABANDONED row of their key -> FAILED) was a plain
-- UPDATE: it waited for a row another transaction held, while the claim held the rows step
-- 1 had locked. A stalled relay's renewal of its expired lease (no destination lock; it may
-- renew a lease nobody took over yet) locks its batch's rows one by one: holding a row step
-- 1b wanted, it waited for one step 1 was abandoning, and PostgreSQL failed one of the two
-- after deadlock_timeout (40P01): the claim (an outage, backed off) or the renewal.
-- Step 1b now locks its rows as every other step does, SKIP LOCKED; a row passed over
-- (a renewal holds it, which then keeps it) waits for a later claim.
-- (tests/integration/test_audit18_deadlock_pg_claim_renew.py reproduces the deadlock.)
-- The rest of the claim is migration 0013's (the partitioned layout's:
-- partitioned/0013_recovery_skips_used_up_rows_partitioned.sql), replaced in place: relays
-- of the previous version call the same function, and only gain the fix.

CREATE OR REPLACE FUNCTION {schema}.{table_raw}_claim(
    p_destination text, p_relay_id text, p_lease uuid, p_limit integer,
    p_lock_seconds float8, p_abandoned_blocks boolean, p_max_attempts integer,
    p_recover boolean, p_lock_key bigint, p_max_bytes bigint)
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
    -- Lock order (no deadlock): the destination lock is the one lock a claim waits for,
    -- taken first, while the claim holds no other. Every row it locks after that it locks
    -- SKIP LOCKED (steps 1, 1b, 2 and 3), and its UPDATEs change only rows it locked, so it
    -- never waits for a row while holding one: no lock cycle can go through a claim. (It
    -- may wait for the table's lock at its first statement, holding the destination lock;
    -- everyone else who takes a destination lock takes it before any lock on the table:
    -- settles, requeues, purges, release_unanswered.)
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

    -- 1b. PROCESSING, lease expired, behind an ABANDONED row of its key while abandoned rows
    --     block -> FAILED, due now. Invariants:
    --  * only a dead relay leaves such a row: it held the key's rows in one batch, and the
    --    key's first row was then recovered and abandoned (step 1) at its last attempt. A
    --    claim never takes a row behind a blocking abandoned one, and a settle that abandons
    --    a row releases its batch's later rows of that key;
    --  * in flight, the row never headed its key again (step 2 passes it over) nor was it
    --    claimed (step 3 takes PENDING | FAILED only): it stayed PROCESSING for good, and
    --    once an operator requeued the abandoned row (PENDING: no longer a blocker), step 2
    --    recovered it, and it was published, before that row. FAILED, it waits behind the
    --    abandoned row as its key's other rows do, and is claimed after it in seq order;
    --  * the attempt that died counts, as on a takeover; a row whose attempts that uses up
    --    is left to step 1 of the next claim (abandoned, not FAILED at max_attempts);
    --  * a renewal by a stalled holder that lands first keeps its row (FOR UPDATE checks
    --    locked_until again on the row's current version), and one under way keeps it too:
    --    the row is locked, and passed over (SKIP LOCKED) rather than waited for (see the
    --    lock order above). A row passed over stays in flight, holding back its key, until
    --    a later claim's step 1b.
    -- Without p_abandoned_blocks such a row heads its key and step 2 recovers it, alone.
    IF p_abandoned_blocks THEN
        WITH stranded AS MATERIALIZED (
            SELECT o.created_at AS row_created, o.tableoid AS row_table, o.ctid AS row_id
            FROM {outbox} AS o
            WHERE o.destination = p_destination
              AND o.status = 'PROCESSING'
              AND o.locked_until < now()
              AND o.attempts + 1 < p_max_attempts
              AND o.key IS NOT NULL
              AND EXISTS (SELECT 1 FROM {outbox} AS a
                          WHERE a.destination = p_destination
                            AND a.key = o.key
                            AND a.status = 'ABANDONED'
                            AND a.seq < o.seq)
            ORDER BY o.seq
            FOR UPDATE SKIP LOCKED
        )
        UPDATE {outbox} AS t
        SET status = 'FAILED',
            attempts = t.attempts + 1,
            next_attempt_at = now(),
            last_error = 'relay ' || coalesce(t.locked_by, '?')
                         || ' died or stalled while publishing this message (its lease expired)',
            locked_by = NULL, locked_until = NULL, lease = NULL, updated_at = now()
        FROM stranded
        WHERE t.created_at = stranded.row_created AND t.tableoid = stranded.row_table
          AND t.ctid = stranded.row_id;
    END IF;

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
    --  * the attempt that died counts, and stays below max_attempts: the walk passes over
    --    the used-up rows step 1 left (more of them than p_limit), and last_error names the
    --    relay that held the row.
    -- The rows whose lease expired are walked in seq order and probed one by one: the first
    -- one usually heads its key, so a claim probes one row, however many wait.
    FOR candidate IN
        SELECT o.created_at AS row_created, o.tableoid AS row_table, o.ctid AS row_id,
               o.seq AS row_seq, o.key AS row_key
        FROM {outbox} AS o
        WHERE o.destination = p_destination
          AND o.status = 'PROCESSING'
          AND o.locked_until < now()
          -- Used up (step 1 abandons them, p_limit a claim): never taken over, which would
          -- be an attempt past max_attempts. Passed over, as a row behind it of its key is.
          AND o.attempts + 1 < p_max_attempts
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
    --    its invariants kept, with three more:
    --  * the byte budget (0010): the due rows, in seq order, are taken while the payload
    --    bytes of the rows before them stay under p_max_bytes: at most p_max_bytes plus one
    --    row, and at least one row, so a payload larger than the budget goes out alone.
    --    The cut is a seq-order prefix: no row is taken after one left out, so no key's
    --    later row passes its earlier one. octet_length reads a TOASTed value's header,
    --    not the value; the rows past the cut stay locked until commit, untouched;
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
               o.seq AS row_seq, o.key AS row_key,
               octet_length(o.payload) AS row_bytes
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
    -- The seq-order prefix within the byte budget (bytes of the rows before each < budget).
    within_budget AS MATERIALIZED (
        SELECT d.row_created, d.row_table, d.row_id, d.row_seq, d.row_key
        FROM (SELECT d.*, coalesce(sum(d.row_bytes) OVER (
                  ORDER BY d.row_seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                  AS bytes_before
              FROM due AS d) AS d
        WHERE d.bytes_before < p_max_bytes
    ),
    passed_over AS MATERIALIZED (
        SELECT e.key AS row_key, min(e.seq) AS first_seq
        FROM {outbox} AS e
        WHERE e.destination = p_destination
          AND e.status IN ('PENDING', 'FAILED', 'PROCESSING')
          AND e.key IS NOT NULL
          AND e.seq < (SELECT max(d.row_seq) FROM within_budget AS d)
          AND e.seq NOT IN (SELECT d.row_seq FROM within_budget AS d)
        GROUP BY e.key
    )
    UPDATE {outbox} AS t
    SET status = 'PROCESSING',
        locked_by = p_relay_id,
        lease = p_lease,
        locked_until = now() + make_interval(secs => p_lock_seconds),
        updated_at = now()
    FROM within_budget AS due
    WHERE t.created_at = due.row_created AND t.tableoid = due.row_table
      AND t.ctid = due.row_id
      AND NOT EXISTS (SELECT 1 FROM passed_over AS p
                      WHERE p.row_key = due.row_key AND p.first_seq < due.row_seq)
    RETURNING t.seq, t.id, t.destination, t.topic, t.key, t.payload, t.content_type,
              CAST(t.headers AS text) AS headers, t.attempts, t.created_at,
              CAST('claimed' AS text) AS taken, t.last_error;
END
$fn$;
