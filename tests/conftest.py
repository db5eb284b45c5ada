"""Fixtures: a fresh database per test (PostgreSQL clones a template that has the schema)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from outboxer.stores import create_store
from tests.chaos.proxy import FaultProxy
from tests.services import require

#: Tests that run alone, after the others (scripts/test runs the rest on three workers): they
#: stop or restart a shared service, count the machine's sockets, start private servers on
#: fixed ports, or measure under load; or their reports carry bytes the workers' channel
#: cannot send (a lone surrogate).
SERIAL = (
    "tests/chaos/",
    # The private PostgreSQL with wal_level=logical (one per session) and the pgmodes benches;
    # the partitioned and log layouts' other tests use the shared server and run in parallel.
    "tests/pgmodes/test_audit10_walslot_lost.py",
    "tests/pgmodes/test_audit10_walwarn_slot_at_risk.py",
    "tests/pgmodes/test_audit12_upkeep_stress.py",  # ~8 s of writers, relays and upkeep
    "tests/pgmodes/test_bench_",
    "tests/pgmodes/test_debezium_layout.py",
    "tests/pgmodes/test_stream_audit2_lock.py",
    "tests/pgmodes/test_stream_audit2_unstorable.py",
    "tests/pgmodes/test_stream_poison.py",
    "tests/pgmodes/test_stream_relay_command.py",
    "tests/pgmodes/test_streamrelay_cli.py",
    "tests/pgmodes/test_wal_mode.py",
    "tests/integration/test_broker_connect_leaks.py",
    "tests/integration/test_receiver_connect_leaks.py",
    "tests/unit/test_config_audit_logs.py",
    "tests/integration/test_audit11_webhook_trickled_headers.py",
    "tests/integration/test_audit11_group_recovery_beside_a_hung_database.py",
    "tests/integration/test_audit11_wave_partial_timeout.py",
    "tests/integration/test_audit11_cancel_shutdown_leases.py",
    "tests/integration/test_audit11_cancel_shutdown_claim_wait.py",
    "tests/integration/test_audit11_mdbstop_claim_wait.py",
    "tests/integration/test_audit11_flap_redis_bulk_limit.py",
    "tests/integration/test_audit11_wave2_deadline.py",
    "tests/integration/test_audit12_config_claimcheck_put_errors.py",
    "tests/integration/test_audit12_ccretain_dead_letter_hold.py",  # a moto S3 server
    "tests/integration/test_audit12_mytls_private_server.py",  # a private MariaDB with TLS
    "tests/integration/test_audit12_preferred_private_server.py",  # the same private MariaDB
    "tests/integration/test_audit12_loris_webhook.py",  # private uvicorn servers, timings
    "tests/integration/test_audit13_mqtt_size_limit.py",  # a private Mosquitto
    "tests/integration/test_audit13_testing_private_postgres.py",  # a private initdb, temp dirs
)
#: Single tests that run alone, by name, wherever they are: the broker contract's restart
#: (it stops the shared RabbitMQ, Redis, NATS or Mosquitto; the rest of those files shares
#: them as any test does).
SERIAL_TESTS = ("test_reconnects_after_server_restart",)
_ROOT = Path(__file__).resolve().parent.parent
#: Ends a worker whose test outlived its timeout by far (tests/watchdog.py); records each
#: test's timings when OUTBOXER_TEST_TIMINGS names a directory (tests/timings.py).
pytest_plugins = ["tests.watchdog", "tests.timings"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve().relative_to(_ROOT).as_posix()
        name = getattr(item, "originalname", item.name)
        if path.startswith(SERIAL) or name in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session", autouse=True)
def _nats_streams_directory() -> None:
    """One JetStream stream on the shared NATS server that no test deletes.

    nats-server (2.x here) removes its streams directory when the last stream goes, and a
    stream created at that moment on another worker fails "could not create storage
    directory" (err_code 10049, error creating store for stream): two tests deleting and
    creating streams in parallel made each other fail. With this stream the directory stays.
    """
    from tests.services import port_open

    if not port_open(4222):
        return
    try:
        import nats
        from nats.js.api import StreamConfig
    except ImportError:  # the lowest-drivers run installs no nats-py
        return

    async def keep() -> None:
        nc = await nats.connect("nats://127.0.0.1:4222", connect_timeout=5)
        try:
            js = nc.jetstream()
            try:
                await js.stream_info("OUTBOXER_TESTS_KEEP")
            except nats.js.errors.NotFoundError:
                config = StreamConfig(name="OUTBOXER_TESTS_KEEP", subjects=["outboxer-tests.keep"])
                with contextlib.suppress(nats.js.errors.BadRequestError):  # another worker's
                    await js.add_stream(config)
        finally:
            await nc.close()

    asyncio.run(keep())


PG_ADMIN = os.environ.get("OUTBOXER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# One template per pytest process: several runs (a developer's and CI's, or parallel
# worktrees) share the server, and one run must not drop the template another is cloning.
TEMPLATE = f"outboxer_test_template_{os.getpid()}"
MYSQL_ADMIN = os.environ.get("OUTBOXER_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")


def _apply_schema(url: str) -> None:
    async def apply() -> None:
        async with create_store(url) as store:
            await store.apply_schema()

    asyncio.run(apply())


def _pg_url(database: str) -> str:
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + database


def _admin_execute(*statements: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database with the outbox schema applied, cloned by every test that needs PostgreSQL."""
    require("postgresql")
    _admin_execute(f"DROP DATABASE IF EXISTS {TEMPLATE}", f"CREATE DATABASE {TEMPLATE}")
    _apply_schema(_pg_url(TEMPLATE))
    yield TEMPLATE
    _admin_execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")


#: PostgreSQL 15's DROP DATABASE forces an immediate checkpoint: dropped behind each test,
#: ~900 checkpoints a CI run, each flushing every database's dirty pages and making every
#: first write after it log a full page image. Dropped when the session ends instead.
DROP_CLONES_AT_END = os.environ.get("OUTBOXER_TEST_DROP_CLONES_AT_END", "1") == "1"


def _pg_clone(template: str) -> str:
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    _admin_execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    return name


def _pg_drop(name: str) -> None:
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def pg_clones(pg_template: str) -> Iterator[Prepared]:
    """Clones of the template made one ahead, dropped behind: a clone costs its test ~70 ms
    (CREATE DATABASE copies the template through the WAL), some 600 tests take one."""
    clones = Prepared(
        functools.partial(_pg_clone, pg_template), _pg_drop, drop_at_close=DROP_CLONES_AT_END
    )
    yield clones
    clones.close()


@pytest.fixture
def pg_url(pg_clones: Prepared) -> Iterator[str]:
    """URL of a fresh PostgreSQL database holding an empty outbox."""
    name = pg_clones.take()
    yield _pg_url(name)
    pg_clones.give_back(name)


@pytest.fixture(scope="session")
def pg_partitioned_template() -> Iterator[str]:
    """A database with the partitioned layout of the outbox (partitions from today on)."""
    require("postgresql")
    name = f"outboxer_test_partitioned_{os.getpid()}"
    _admin_execute(f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}")

    async def apply() -> None:
        async with create_store(_pg_url(name)) as store:
            await store.apply_schema(partitioned=True)

    asyncio.run(apply())
    yield name
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def pg_partitioned_url(pg_partitioned_template: str) -> Iterator[str]:
    """URL of a fresh PostgreSQL database holding an empty partitioned outbox."""
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    _admin_execute(f"CREATE DATABASE {name} TEMPLATE {pg_partitioned_template}")
    yield _pg_url(name)
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file with the outbox schema, closed (its WAL checkpointed into it)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "outbox.db"
    _apply_schema(f"sqlite:///{path}")
    assert not path.with_name("outbox.db-wal").exists(), "the template's WAL was not merged"
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_template: Path) -> Iterator[str]:
    """A copy of the template (applying the schema costs each test ~50 ms of fsyncs)."""
    path = tmp_path / "outbox.db"
    shutil.copyfile(sqlite_template, path)
    yield f"sqlite:///{path}"


def mysql_connect(url: str, **options: Any) -> Any:
    """A PyMySQL connection to the database of a mysql:// URL (not in autocommit)."""
    import pymysql

    from outboxer.stores.mysql import mysql_connect_args

    return pymysql.connect(**mysql_connect_args(url), **options)


async def aiomysql_connect(url: str) -> Any:
    """An aiomysql connection to the database of a mysql:// URL (not in autocommit)."""
    import aiomysql

    from outboxer.stores.mysql import mysql_connect_args

    args = mysql_connect_args(url)
    return await aiomysql.connect(db=args.pop("database"), **args)


@pytest.fixture
def mysql_empty_url() -> Iterator[str]:
    """URL of a fresh, empty MySQL database (MySQL cannot clone one), dropped afterwards."""
    require("mariadb")
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    admin = mysql_connect(MYSQL_ADMIN, autocommit=True)
    try:
        admin.cursor().execute(f"CREATE DATABASE {name}")
    finally:
        admin.close()
    try:
        yield MYSQL_ADMIN.rsplit("/", 1)[0] + "/" + name
    finally:
        _drop_mysql_database(name)


def _drop_mysql_database(name: str) -> None:
    """DROP DATABASE, first ending the sessions still in it (a failed test may leave one open
    in a transaction, and DROP would wait for it), like PostgreSQL's WITH (FORCE)."""
    import pymysql

    admin = mysql_connect(MYSQL_ADMIN, autocommit=True)
    try:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT ID FROM information_schema.PROCESSLIST "
                "WHERE DB = %s AND ID <> CONNECTION_ID()",
                (name,),
            )
            for (session,) in cursor.fetchall():
                with contextlib.suppress(pymysql.err.OperationalError):  # it ended meanwhile
                    cursor.execute(f"KILL {int(session)}")
            cursor.execute(f"DROP DATABASE IF EXISTS {name}")
    finally:
        admin.close()


class Prepared:
    """Databases made ahead of the tests that take them, and dropped behind them, by a thread
    of its own, so that a test does not wait for either. One thread: one statement at a time.

    MySQL: each outbox database costs ~0.2 s of DDL. PostgreSQL: a clone of the template
    and its drop cost a test ~125 ms together (measured: 40 tests of the store contract and
    the HTTP API took 11-14 s this way, 17.7 s making and dropping each in the test's own
    setup and teardown)."""

    def __init__(
        self, make: Callable[[], str], drop: Callable[[str], None], *, drop_at_close: bool = False
    ) -> None:
        self._make, self._drop = make, drop
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="prepared-databases")
        self._next: Future[str] | None = None
        self._drops: list[Future[None]] = []
        #: Names given back, dropped only by ``close`` (``drop_at_close``).
        self._deferred: list[str] | None = [] if drop_at_close else None

    def take(self) -> str:
        """A fresh database (the one made ahead); the making of the next one starts."""
        self._raise_failed_drops()
        made = self._next if self._next is not None else self._worker.submit(self._make)
        self._next = None
        name = made.result()
        self._next = self._worker.submit(self._make)
        return name

    def give_back(self, name: str) -> None:
        """Drop ``name`` behind the test (or at ``close``: ``drop_at_close``); a failure
        surfaces at the next ``take``."""
        if self._deferred is not None:
            self._deferred.append(name)
            return
        self._drops.append(self._worker.submit(self._drop, name))

    def close(self) -> None:
        """Drop the database made ahead, wait for every drop."""
        if self._next is not None:
            with contextlib.suppress(Exception):  # its making failed: nothing to drop
                self.give_back(self._next.result())
            self._next = None
        if self._deferred:
            # Eight at a time: the checkpoints their drops ask for while one runs are served
            # by the next one together.
            with ThreadPoolExecutor(8, thread_name_prefix="deferred-drops") as dropping:
                self._drops += [dropping.submit(self._drop, name) for name in self._deferred]
        self._worker.shutdown(wait=True)
        self._raise_failed_drops()

    def _raise_failed_drops(self) -> None:
        done = [drop for drop in self._drops if drop.done()]
        self._drops = [drop for drop in self._drops if not drop.done()]
        for drop in done:
            drop.result()


def _make_mysql_outbox() -> str:
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    admin = mysql_connect(MYSQL_ADMIN, autocommit=True)
    try:
        admin.cursor().execute(f"CREATE DATABASE {name}")
    finally:
        admin.close()
    try:
        _apply_schema(MYSQL_ADMIN.rsplit("/", 1)[0] + "/" + name)
    except BaseException:
        _drop_mysql_database(name)
        raise
    return name


@pytest.fixture(scope="session")
def mysql_outboxes() -> Iterator[Prepared]:
    """MySQL databases holding an empty outbox, made ahead (MySQL cannot clone one)."""
    require("mariadb")
    outboxes = Prepared(_make_mysql_outbox, _drop_mysql_database)
    yield outboxes
    outboxes.close()


@pytest.fixture
def mysql_url(mysql_outboxes: Prepared) -> Iterator[str]:
    """URL of a fresh MySQL database holding an empty outbox, dropped afterwards."""
    name = mysql_outboxes.take()
    yield MYSQL_ADMIN.rsplit("/", 1)[0] + "/" + name
    mysql_outboxes.give_back(name)


@pytest.fixture
async def rabbit_consumer() -> AsyncIterator[object]:
    """A RabbitMQ consumer on a fresh exchange; its ``broker_url`` publishes there."""
    from tests.rabbit import RabbitConsumer

    require("rabbitmq")
    consumer = await RabbitConsumer().start()
    yield consumer
    await consumer.stop()


@pytest.fixture
async def pg_store(pg_url: str) -> AsyncIterator[object]:
    store = create_store(pg_url)
    await store.connect()
    yield store
    await store.close()


@pytest.fixture
def exporter() -> Iterator[Any]:
    """The OpenTelemetry SDK's in-memory span exporter, empty at the start of the test."""
    from tests.otel import memory_exporter

    spans = memory_exporter()
    spans.clear()
    yield spans
    spans.clear()


@pytest.fixture
def pg_proxy() -> Iterator[FaultProxy]:
    """A fault proxy in front of the shared PostgreSQL (point a URL at ``pg_proxy.port``):
    the test stalls or cuts its connections, the teardown lets them go."""
    proxy = FaultProxy(5432).start()
    yield proxy
    proxy.resume()
    proxy.stop()


@pytest.fixture
async def redis_stream() -> AsyncIterator[str]:
    """A fresh Redis stream name (the topic a test publishes to); deleted afterwards."""
    import redis.asyncio as aioredis

    require("redis")
    topic = f"test-{uuid.uuid4().hex[:12]}"
    yield topic
    client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")
    await client.delete(topic)
    await client.aclose()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """librdkafka's mock cluster (a MockCluster of tests/integration/test_broker_kafka.py),
    one per test module; skipped where librdkafka exposes no mock cluster API."""
    from tests.integration.test_broker_kafka import MockCluster  # confluent-kafka: lazily

    mock = MockCluster()
    if mock._handle is None:
        mock.stop()
        pytest.skip("this librdkafka exposes no mock cluster API")
    yield mock
    mock.stop()
