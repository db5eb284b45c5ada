"""What the contrib tests share: the outbox as a relay sees it, and SQLAlchemy URLs."""

from __future__ import annotations

import asyncio

from outboxer.message import Message
from outboxer.stores import create_store


async def claim_all_async(url: str) -> list[Message]:
    """Every due message, in publish order, as a relay's claim returns them."""
    async with create_store(url) as store:
        return await store.claim("default", "test-relay", 1000, 30.0, False)


def claim_all(url: str) -> list[Message]:
    return asyncio.run(claim_all_async(url))


def sqlalchemy_url(url: str, *, asynchronous: bool = False) -> str:
    """The SQLAlchemy URL of a test database URL, with the driver the test wants."""
    scheme, rest = url.split("://", 1)
    drivers = {
        "postgresql": ("postgresql+psycopg", "postgresql+asyncpg"),
        "mysql": ("mysql+pymysql", "mysql+aiomysql"),
        "sqlite": ("sqlite", "sqlite+aiosqlite"),
    }
    return f"{drivers[scheme][asynchronous]}://{rest}"
