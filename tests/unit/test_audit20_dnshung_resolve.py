"""outboxer.brokers.resolve: a broker's host is looked up once per question under way, on a
thread of its own, whoever asks meanwhile; other names as the loop would; a caller that
gives up leaves the others their answer."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer.brokers import resolve

NAME = "broker.resolve-test.invalid"
ADDRESS = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 5672))]


class Resolver:
    """socket.getaddrinfo for NAME (and ``other``): blocks until ``answer`` is set."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.error: BaseException | None = None
        self.threads: list[str] = []

    def __call__(self, host: Any, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        self.answer.wait(10)
        if self.error is not None:
            raise self.error
        return list(ADDRESS)


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Resolver]:
    fake = Resolver()
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    try:
        yield fake
    finally:
        fake.answer.set()


async def until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never")


async def test_callers_of_one_question_share_its_lookup_and_one_may_give_up(
    resolver: Resolver,
) -> None:
    loop = asyncio.get_running_loop()
    assert resolve.install(loop, [NAME.upper()])  # host names are not case-sensitive
    first = asyncio.ensure_future(loop.getaddrinfo(NAME, 5672, type=socket.SOCK_STREAM))
    second = asyncio.ensure_future(loop.getaddrinfo(NAME, 5672, type=socket.SOCK_STREAM))
    given_up = asyncio.ensure_future(loop.getaddrinfo(NAME, 5672, type=socket.SOCK_STREAM))
    await until(lambda: resolver.threads)
    given_up.cancel()  # a connect that timed out
    await asyncio.sleep(0.05)
    resolver.answer.set()
    one, two = await asyncio.gather(first, second)
    assert one == two == ADDRESS and one is not two
    assert resolver.threads == [resolve.THREAD_NAME]
    assert given_up.cancelled()
    # Nothing cached: the next question is asked again.
    assert await loop.getaddrinfo(NAME, 5672, type=socket.SOCK_STREAM) == ADDRESS
    assert len(resolver.threads) == 2


async def test_each_caller_gets_the_lookups_error(resolver: Resolver) -> None:
    loop = asyncio.get_running_loop()
    resolve.install(loop, [NAME])
    resolver.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    resolver.answer.set()
    outcomes = await asyncio.gather(
        loop.getaddrinfo(NAME, 1), loop.getaddrinfo(NAME, 1), return_exceptions=True
    )
    assert all(isinstance(o, socket.gaierror) and o.errno == socket.EAI_AGAIN for o in outcomes)
    assert outcomes[0] is not outcomes[1]


async def test_other_names_and_lookups_past_the_bound_go_to_the_loops_own_executor(
    resolver: Resolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = asyncio.get_running_loop()
    resolve.install(loop, [NAME])
    monkeypatch.setattr(resolve, "MAX_LOOKUPS", 1)
    under_way = asyncio.ensure_future(loop.getaddrinfo(NAME, 1))
    await until(lambda: len(resolver.threads) == 1)
    past = asyncio.ensure_future(loop.getaddrinfo(NAME, 2))  # another question, no place
    other = asyncio.ensure_future(loop.getaddrinfo("not-a-broker.invalid", 1))
    await until(lambda: len(resolver.threads) == 3)
    resolver.answer.set()
    await asyncio.gather(under_way, past, other)
    assert resolver.threads[0] == resolve.THREAD_NAME
    assert not any(name.startswith(resolve.THREAD_NAME) for name in resolver.threads[1:])


def test_a_loop_whose_getaddrinfo_was_replaced_is_left_alone() -> None:
    loop = asyncio.new_event_loop()
    try:

        async def theirs(*args: Any, **kwargs: Any) -> list[Any]:
            return []

        loop.getaddrinfo = theirs  # type: ignore[method-assign]
        assert not resolve.install(loop, [NAME])
        assert loop.getaddrinfo is theirs
    finally:
        loop.close()


def test_hosts_of_urls() -> None:
    assert resolve.hosts_of("amqp://user:p%40ss@Broker.example:5672/vhost") == ["Broker.example"]
    assert resolve.hosts_of("nats://u:p@a.example:4222,b.example:4222") == [
        "a.example",
        "b.example",
    ]
    assert resolve.hosts_of("https://hooks.example/path?x=1") == ["hooks.example"]
    assert resolve.hosts_of("redis://[::1]:6379/0") == []
    assert resolve.hosts_of("memory://name") == ["name"]
