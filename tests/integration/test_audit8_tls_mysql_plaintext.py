"""A MySQL URL with ``ssl_mode`` required/verify_ca/verify_identity refuses a server that does
not offer TLS. The local MariaDB has TLS off (``have_ssl DISABLED``), as a server that was
never given certificates, or one behind a man in the middle that strips TLS from its greeting:
aiomysql (the relay's store, ``outboxer status``) connected to it in plaintext."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

import pytest

from outboxer.consumer import Consumer
from outboxer.errors import InsecureConnectionError
from outboxer.stores import create_store
from outboxer.stores.mysql import MySQLStore, mysql_connect_args

REFUSED = "does not offer TLS"


def with_query(url: str, query: str) -> str:
    return f"{url}?{query}"


@pytest.mark.parametrize("mode", ["required", "verify_ca", "verify_identity", "REQUIRED"])
async def test_the_store_refuses_a_server_without_tls(mysql_url: str, mode: str) -> None:
    with pytest.raises(InsecureConnectionError, match=REFUSED) as caught:
        async with create_store(with_query(mysql_url, f"ssl_mode={mode}")):
            pass
    assert f"ssl_mode={mode.lower()}" in str(caught.value)


async def test_a_connection_the_pool_opens_later_is_refused_too(mysql_url: str) -> None:
    """The pool opens connections on its own when it runs short: each is checked when taken."""
    async with create_store(mysql_url) as store:
        assert isinstance(store, MySQLStore)
        await store.ping()
        store.connect_args = mysql_connect_args(with_query(mysql_url, "ssl_mode=required"))
        with pytest.raises(InsecureConnectionError, match=REFUSED):
            await store.status()


async def test_disabled_or_no_ssl_mode_still_connects_in_plaintext(mysql_url: str) -> None:
    for url in (mysql_url, with_query(mysql_url, "ssl_mode=disabled")):
        async with create_store(url) as store:
            await store.ping()


def test_the_status_command_fails_with_the_reason(
    mysql_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from outboxer.cli import main

    assert main(["status", "--db", with_query(mysql_url, "ssl_mode=required")]) != 0
    captured = capsys.readouterr()
    assert REFUSED in captured.err + captured.out


def test_a_pymysql_connection_is_refused_before_the_login(mysql_url: str) -> None:
    """A wrong password shows where the check runs: the refusal, not 'Access denied', so the
    login (which a man in the middle can turn into the password in clear) never went out."""
    from outboxer.payload_admin import connect

    parts = urlsplit(mysql_url)
    wrong = parts._replace(netloc=f"root:not-the-password@{parts.hostname}:{parts.port}")
    for url in (mysql_url, urlunsplit(wrong)):
        with pytest.raises(InsecureConnectionError, match=REFUSED) as caught:
            connect(with_query(url, "ssl_mode=required"))
        assert "not-the-password" not in str(caught.value)


def test_the_consumer_fails_with_the_reason(mysql_url: str) -> None:
    consumer = Consumer(
        db=with_query(mysql_url, "ssl_mode=verify_identity"),
        broker="memory://audit8-tls",
        group="g",
        handler=lambda message, conn: None,
        exit_when_idle=True,
    )
    # Fatal at start, not retried as an outage: the server will not start offering TLS.
    with pytest.raises(InsecureConnectionError, match=REFUSED):
        asyncio.run(asyncio.wait_for(consumer.run_async(), 10))


async def test_the_relay_does_not_start(mysql_url: str) -> None:
    from outboxer import Relay, load_settings
    from outboxer.brokers.memory import MemoryPublisher

    url = with_query(mysql_url, "ssl_mode=required")
    settings = load_settings({"db": url}, environ={})
    relay = Relay(create_store(url), {"default": MemoryPublisher("memory://audit8-tls")}, settings)
    # Fatal, as a missing schema: not logged as an outage and retried for ever.
    with pytest.raises(InsecureConnectionError, match=REFUSED):
        await asyncio.wait_for(relay.run(), 10)
