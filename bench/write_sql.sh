#!/usr/bin/env bash
# Where enqueue's database cost goes, without Python: pgbench runs outboxer's insert SQL
# and a plain INSERT of the same row into a table with only a primary key, then the
# outbox insert with one piece of outboxer's machinery taken away at a time.
#
#   bash bench/write_sql.sh [rounds]      # 8 clients, 6 s a variant, 3 rounds by default
#
# Every commit waits for the WAL flush (synchronous_commit on), statements are prepared
# (as psycopg prepares a statement it runs often). It uses a scratch database,
# outboxer_bench_write_sql, dropped at the end; it changes nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${1:-3}
PG=(-h 127.0.0.1 -U postgres)
DB=outboxer_bench_write_sql
export PGOPTIONS="-c client_min_messages=warning"
WORK=$(mktemp -d)
trap 'psql "${PG[@]}" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" postgres; rm -rf "$WORK"' EXIT

psql "${PG[@]}" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" postgres
.venv/bin/python - "$DB" <<'EOF'
import sys
import psycopg
from outboxer.stores.postgres import PostgresStore
url = f"postgresql://postgres@127.0.0.1/{sys.argv[1]}"
with psycopg.connect(url, autocommit=True) as conn:
    conn.execute(PostgresStore(url).schema_sql().encode())
    # The bench's control table (bench/writers.py): the outbox's message columns, a key.
    conn.execute("CREATE TABLE bench_events (id uuid PRIMARY KEY, topic text NOT NULL, key text,"
                 " payload bytea NOT NULL, content_type text NOT NULL, headers jsonb NOT NULL,"
                 " created_at timestamptz NOT NULL DEFAULT now())")
EOF

# A ~300-byte JSON payload and a traceparent header, as the bench's events carry.
PAYLOAD="'\\x$(printf '{"order_id":123,"customer":"customer-00012","total":"123.45","currency":"EUR","note":"%0212d"}' 0 | od -An -tx1 -v | tr -d ' \n')'::bytea"
HEADERS="'{\"traceparent\":\"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}'::jsonb"

# outboxer's insert (queries.sql): the key lock, then the row.
cat > "$WORK/outbox.sql" <<EOF
\set k random(1, 10000)
BEGIN;
INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type, headers)
SELECT gen_random_uuid(), 'default', 'order.placed', m.key, $PAYLOAD, 'application/json', $HEADERS
FROM (SELECT CAST('customer-' || :k AS text) AS key) AS m
LEFT JOIN LATERAL (SELECT pg_advisory_xact_lock(hashtextextended('outboxer-key:' || m.key, 0))
                   WHERE m.key IS NOT NULL) AS key_lock ON true;
COMMIT;
EOF
# The same row without the key lock.
cat > "$WORK/outbox_no_lock.sql" <<EOF
\set k random(1, 10000)
BEGIN;
INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type, headers)
VALUES (gen_random_uuid(), 'default', 'order.placed', 'customer-' || :k, $PAYLOAD, 'application/json', $HEADERS);
COMMIT;
EOF
# The control: the same event into the plain table.
cat > "$WORK/plain.sql" <<EOF
\set k random(1, 10000)
BEGIN;
INSERT INTO bench_events (id, topic, key, payload, content_type, headers)
VALUES (gen_random_uuid(), 'order.placed', 'customer-' || :k, $PAYLOAD, 'application/json', $HEADERS);
COMMIT;
EOF

tps() {
    pgbench "${PG[@]}" -M prepared -n -c 8 -j 2 -T 6 -f "$WORK/$1.sql" "$DB" 2>&1 \
        | awk '/^tps/ {printf "%d", $3}'
}
sql() { psql "${PG[@]}" -qc "$1" "$DB"; }

echo "transactions/s, 8 clients (ratio to plain)"
for round in $(seq "$ROUNDS"); do
    sql "VACUUM outboxer.outbox"; sql "VACUUM bench_events"
    plain=$(tps plain); full=$(tps outbox); no_lock=$(tps outbox_no_lock)
    sql "ALTER TABLE outboxer.outbox DISABLE TRIGGER outbox_notify"
    no_trigger=$(tps outbox); neither=$(tps outbox_no_lock)
    sql "DROP INDEX outboxer.outbox_ready_idx"
    bare_row=$(tps outbox_no_lock)
    sql "CREATE INDEX outbox_ready_idx ON outboxer.outbox (destination, seq)
         WHERE status IN ('PENDING', 'FAILED', 'PROCESSING')"
    sql "ALTER TABLE outboxer.outbox ENABLE TRIGGER outbox_notify"
    ratio() { awk -v a="$1" -v b="$plain" 'BEGIN {printf "%d (%.2f)", a, a / b}'; }
    echo "round $round: plain $plain | outbox $(ratio "$full") | no key lock $(ratio "$no_lock")" \
         "| no wake-up trigger $(ratio "$no_trigger") | neither $(ratio "$neither")" \
         "| neither, no ready index $(ratio "$bare_row")"
done
