"""The order service: FastAPI and SQLAlchemy (async). An order and its ``order.placed`` event
commit in one transaction: the entity records the event, the session's flush enqueues it.

Run: ``ORDERS_DB_URL=postgresql+asyncpg://… uvicorn orders_service:app`` (run.py does).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import String
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outboxer.contrib.sqlalchemy import RecordsEvents, listen

engine = create_async_engine(os.environ["ORDERS_DB_URL"], pool_size=10)
Session = async_sessionmaker(engine, expire_on_commit=False)
listen(Session)  # every flush of these sessions writes the recorded events


class Base(DeclarativeBase):
    pass


class Order(RecordsEvents, Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(64))
    total: Mapped[float]

    def place(self) -> None:
        # Called at flush, after the INSERT: the id exists. One key per customer keeps a
        # customer's events in order.
        self.record_event(
            "order.placed",
            lambda: {"id": self.id, "customer": self.customer, "total": self.total},
            key=self.customer,
        )


class NewOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=64)
    total: float = Field(gt=0)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield
    await engine.dispose()


app = FastAPI(title="orders", lifespan=lifespan)


@app.post("/orders", status_code=201)
async def place_order(new: NewOrder) -> dict[str, int]:
    async with Session.begin() as session:  # commits the order and its event, or neither
        order = Order(customer=new.customer, total=new.total)
        session.add(order)
        order.place()
    return {"id": order.id}


@app.get("/orders/{order_id}")
async def get_order(order_id: int) -> dict[str, object]:
    async with Session() as session:
        order = await session.get(Order, order_id)
    if order is None:
        raise HTTPException(404, f"no order {order_id}")
    return {"id": order.id, "customer": order.customer, "total": order.total}


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}
