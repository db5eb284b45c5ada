"""The Debezium layout, proved the way Debezium reads it: the table's inserts decoded
through a pgoutput slot, then Debezium's documented EventRouter defaults applied.

EventRouter defaults (Debezium's outbox event router documentation): only inserts are
routed (deletes skipped); topic = route.topic.replacement "outbox.event.${routedByValue}"
with route.by.field = aggregatetype; record key = table.field.event.key = aggregateid;
record value = table.field.event.payload = payload; header "id" = table.field.event.id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import PayloadError
from outboxer.stores.pgdebezium import PgDebezium
from outboxer.stores.pgoutput import Insert, Relation, decode

#: Debezium's documented outbox table: column -> (type, NOT NULL).
DEBEZIUM_COLUMNS = {
    "id": ("uuid", True),
    "aggregatetype": ("character varying(255)", True),
    "aggregateid": ("character varying(255)", True),
    "type": ("character varying(255)", True),
    "payload": ("jsonb", False),
}


@dataclass(frozen=True)
class KafkaRecord:
    topic: str
    key: str
    value: str
    headers: dict[str, str]


def event_router(relation: Relation, insert: Insert) -> KafkaRecord:
    """The EventRouter's default rules, applied to one decoded insert."""
    row = dict(zip(relation.columns, insert.values, strict=True))
    assert row["aggregatetype"] is not None and row["aggregateid"] is not None
    assert row["payload"] is not None and row["id"] is not None
    return KafkaRecord(
        topic=f"outbox.event.{row['aggregatetype']}",
        key=row["aggregateid"],
        value=row["payload"],
        headers={"id": row["id"]},
    )


@pytest.fixture
async def debezium_url(logical_url: str) -> str:
    async with PgDebezium(logical_url) as table:
        assert await table.apply_schema() == ["0001_debezium"]
    with psycopg.connect(logical_url, autocommit=True) as conn:
        # What the connector does with publication.autocreate.mode=filtered and slot.name.
        conn.execute("CREATE PUBLICATION outboxer_debezium FOR TABLE outboxer.outbox_debezium")
        conn.execute("SELECT pg_create_logical_replication_slot('dbz_test', 'pgoutput')")
    return logical_url


def _records(url: str) -> list[KafkaRecord]:
    relations: dict[int, Relation] = {}
    records = []
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes('dbz_test', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'outboxer_debezium')"
        ).fetchall()
    for (data,) in rows:
        item = decode(bytes(data))
        if isinstance(item, Relation):
            relations[item.relation_id] = item
        elif isinstance(item, Insert):
            records.append(event_router(relations[item.relation_id], item))
    return records


def test_table_has_debeziums_documented_columns(debezium_url: str) -> None:
    with psycopg.connect(debezium_url) as conn:
        rows = conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull "
            "FROM pg_attribute AS a WHERE a.attrelid = 'outboxer.outbox_debezium'::regclass "
            "AND a.attnum > 0 AND NOT a.attisdropped"
        ).fetchall()
    found = {name: (kind, not_null) for name, kind, not_null in rows}
    for column, expected in DEBEZIUM_COLUMNS.items():
        assert found[column] == expected


def test_event_router_reads_enqueued_rows_in_commit_order(debezium_url: str) -> None:
    outbox = Outbox(mode="debezium")
    with psycopg.connect(debezium_url) as conn:
        first = outbox.enqueue(conn, "order", {"n": 1}, key="order-7")
        second = outbox.enqueue(
            conn, "order", {"n": 2}, key="order-7", headers={"type": "OrderPaid"}
        )
    with psycopg.connect(debezium_url) as conn:
        outbox.enqueue(conn, "order", {"n": -1}, key="order-7")
        conn.rollback()
    with psycopg.connect(debezium_url) as conn:
        keyless = outbox.enqueue(conn, "customer", {"n": 3})
    records = _records(debezium_url)
    assert [(r.topic, r.key, json.loads(r.value)) for r in records] == [
        ("outbox.event.order", "order-7", {"n": 1}),
        ("outbox.event.order", "order-7", {"n": 2}),
        ("outbox.event.customer", str(keyless.id), {"n": 3}),
    ]
    assert [r.headers["id"] for r in records] == [str(first.id), str(second.id), str(keyless.id)]
    with psycopg.connect(debezium_url) as conn:
        types = conn.execute(
            "SELECT type FROM outboxer.outbox_debezium ORDER BY created_at, type"
        ).fetchall()
    assert sorted(t for (t,) in types) == ["OrderPaid", "customer", "order"]


def test_debezium_mode_refuses_non_json_payloads(debezium_url: str) -> None:
    with psycopg.connect(debezium_url) as conn:
        with pytest.raises(PayloadError, match="JSON payloads only"):
            Outbox(mode="debezium").enqueue(conn, "order", b"\x00raw")
        assert conn.execute("SELECT count(*) FROM outboxer.outbox_debezium").fetchone() == (0,)


async def test_retention_deletes_old_rows_only(debezium_url: str) -> None:
    with psycopg.connect(debezium_url) as conn:
        Outbox(mode="debezium").enqueue(conn, "order", {"n": 1})
        conn.execute("UPDATE outboxer.outbox_debezium SET created_at = now() - interval '2 days'")
        Outbox(mode="debezium").enqueue(conn, "order", {"n": 2})
    async with PgDebezium(debezium_url) as table:
        assert isinstance(table, PgDebezium)
        assert await table.cleanup(retention=86400) == 1
    with psycopg.connect(debezium_url) as conn:
        assert conn.execute("SELECT count(*) FROM outboxer.outbox_debezium").fetchone() == (1,)


def test_connector_config_routes_this_table() -> None:
    config = PgDebezium("postgresql://db/app").connector_config(database="app")
    assert config["table.include.list"] == "outboxer.outbox_debezium"
    assert config["transforms.outbox.type"] == "io.debezium.transforms.outbox.EventRouter"
    assert config["plugin.name"] == "pgoutput"


def test_event_router_sees_racing_writers_in_commit_order(debezium_url: str) -> None:
    outbox = Outbox(mode="debezium")
    with psycopg.connect(debezium_url) as early, psycopg.connect(debezium_url) as late:
        outbox.enqueue(early, "order", {"n": 1}, key="a")  # written first, committed last
        outbox.enqueue(late, "order", {"n": 2}, key="b")
        late.commit()
        early.commit()
    assert [json.loads(r.value)["n"] for r in _records(debezium_url)] == [2, 1]
