"""Scenario 1: the PostgreSQL server crashes and restarts during a drain, then the relays'
database sessions are killed with pg_terminate_backend during the drain."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest

from tests.chaos.harness import (
    RabbitSink,
    RelayFleet,
    SteadyWriter,
    Workload,
    finish,
    first_deliveries,
    relay_args,
    report,
    retried,
    sleep_until,
    wait_for_drain,
    wait_for_progress,
)
from tests.chaos.servers import PrivatePostgres, PrivateRabbitMQ

KEYS = [f"key-{k:02d}" for k in range(50)]
MESSAGES = 6_000
WRITE_SECONDS = 12.0
DOWN_SECONDS = 3.0
#: A crash undoes what the relays committed just before it: their claims and settles run
#: with synchronous_commit=off (README, "The relay"), and PostgreSQL's WAL writer flushes
#: such commits within 3 x wal_writer_delay (600 ms). Rows claimed or settled then are
#: published again. So a message the consumer first saw from this long before the crash
#: (those 600 ms, a batch's publish time, a loaded box's scheduling) until this long after
#: the server is back (the consumer's lag) counts as in flight at the crash: nothing is
#: claimed while the server is down.
CRASH_MARGIN = 2.0


#: How long a relay may take to hold a session again: after an outage its reconnects back
#: off exponentially (0.2 s doubling, capped at 15 s, ±25 %): a 3 s crash can leave the next
#: try about 4 s after the server is back, more on a loaded box.
RECONNECT_SECONDS = 20.0


def terminate_relay_sessions(server: PrivatePostgres, db_url: str) -> int:
    """pg_terminate_backend on every session the relays hold on the test's database, once
    they hold one (they may still be backing off from the crash, or from the last cut)."""
    deadline = time.monotonic() + RECONNECT_SECONDS
    with psycopg.connect(server.url(), autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %s AND application_name LIKE 'outboxer-relay%%'",
                (db_url.rsplit("/", 1)[1],),
            ).fetchone()
            assert row is not None
            if row[0] or time.monotonic() > deadline:
                return int(row[0])
            time.sleep(0.05)


@pytest.mark.timeout(180)
def test_postgres_crash_restart_and_killed_sessions_during_a_drain(
    chaos_db: str,
    private_postgres: PrivatePostgres,
    private_rabbitmq: PrivateRabbitMQ,
    rabbit_sink: RabbitSink,
    make_fleet: Callable[..., RelayFleet],
) -> None:
    workload = Workload()
    fleet = make_fleet(chaos_db, private_rabbitmq.url(rabbit_sink.exchange), relay_args())
    fleet.start(2)
    writer = SteadyWriter(workload, chaos_db, KEYS, MESSAGES, MESSAGES / WRITE_SECONDS)
    started = time.monotonic()
    writer.start()

    sleep_until(started + 3.0)
    writer.pause()  # the application's writes would fail too; they are not under test
    crashed_at = time.monotonic()
    try:
        private_postgres.stop("immediate")
        time.sleep(DOWN_SECONDS)
    finally:
        private_postgres.start()
    back_at = time.monotonic()
    writer.resume()
    recover_s = wait_for_progress(chaos_db)

    terminated = []
    for at in (8.0, 10.0):
        sleep_until(started + at)
        terminated.append(terminate_relay_sessions(private_postgres, chaos_db))
    assert all(terminated), f"the relays held database sessions to end: {terminated}"

    writer.finish(timeout=60)
    wait_for_drain(rabbit_sink, workload, chaos_db)
    drained = time.monotonic() - started
    near_crash = {
        message_id
        for message_id, at in first_deliveries(rabbit_sink.deliveries).items()
        if crashed_at - CRASH_MARGIN <= at <= back_at + CRASH_MARGIN
    }
    verdict = finish(
        fleet, workload, rabbit_sink, in_flight_at_faults=retried(chaos_db) | near_crash
    )
    report(
        "postgres_outage",
        faults=1 + len(terminated),
        sessions_terminated=sum(terminated),
        down_s=back_at - crashed_at,
        messages=verdict.messages,
        rolled_back=verdict.rolled_back,
        duplicates=verdict.duplicates,
        recover_s=recover_s,
        offered_msg_s=MESSAGES / WRITE_SECONDS,
        throughput_msg_s=verdict.messages / drained,
        seconds=drained,
        log_lines=verdict.log_lines,
    )
