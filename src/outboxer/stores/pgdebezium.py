"""The Debezium layout: an outbox table that Debezium's outbox event router reads as is.

``Outbox(mode="debezium").enqueue(conn, topic, payload, key=...)`` inserts a row with
aggregatetype = topic, aggregateid = key (the message id when keyless), type = the
``type`` header (else the topic), payload = the JSON payload. Debezium's PostgreSQL
connector reads the table's inserts from the WAL and its EventRouter turns each into a
Kafka record on ``outbox.event.<topic>``, keyed by the key, with the event id in the
``id`` header. outboxer's relay does not run for this mode.
"""

from __future__ import annotations

from outboxer.stores.pgmodes import ModeSchema


class PgDebezium(ModeSchema):
    """The ``<schema>.<table>_debezium`` table: its schema, its retention."""

    folder = "pgdebezium"

    async def cleanup(self, retention: float, limit: int = 10_000) -> int:
        """Delete up to ``limit`` rows older than ``retention`` seconds."""
        from outboxer.stores.sqlfiles import to_numbered

        sql, names = to_numbered(self.sql("cleanup"))
        params: dict[str, object] = {"retention": float(retention), "limit": limit}
        status = await self.conn.execute(sql, *(params[n] for n in names))
        return int(str(status).rsplit(" ", 1)[-1])

    def connector_config(
        self,
        *,
        name: str = "outboxer-debezium",
        hostname: str = "localhost",
        port: int = 5432,
        user: str = "postgres",
        database: str = "postgres",
        topic_prefix: str = "outboxer",
        slot_name: str = "outboxer_debezium",
        publication_name: str = "outboxer_debezium",
    ) -> dict[str, str]:
        """The Kafka Connect configuration of a Debezium PostgreSQL connector that reads
        this table through pgoutput and routes it with the EventRouter's defaults (the
        password goes in ``database.password`` or a config provider, never here)."""
        table = f"{self.schema}.{self.names['debezium_raw']}"
        return {
            "name": name,
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "plugin.name": "pgoutput",
            "database.hostname": hostname,
            "database.port": str(port),
            "database.user": user,
            "database.dbname": database,
            "topic.prefix": topic_prefix,
            "slot.name": slot_name,
            "publication.name": publication_name,
            "publication.autocreate.mode": "filtered",
            "table.include.list": table,
            "tombstones.on.delete": "false",
            "transforms": "outbox",
            "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
            "value.converter": "org.apache.kafka.connect.storage.StringConverter",
        }
