"""Several databases in one relay process: a relay per database, publishers shared per broker.

``outboxer relay`` with ``[databases.NAME]`` tables (or a repeated ``--db``) runs one
:class:`~outboxer.relay.Relay` per database, each with its own store, claim loops,
wake-ups (its own LISTEN connection on PostgreSQL), schema check, lease renewals and
retention, and its own back-off when its database is unreachable: a database that is down
holds up its own relay only. What they share:

* the publishers (:class:`~outboxer.relay.PublisherPool`): one per broker URL and
  configuration, so one broker client (connection, producer or pool) for every
  database;
* the :class:`~outboxer.relay.RecoveryGate`: a row recovered from an expired lease is held
  alone in the process, whichever database it comes from (a row that kills its relay
  kills every database's relay);
* one :class:`~outboxer.metrics.Metrics`, its series labelled by database;
* the signals: SIGTERM stops every relay; each finishes its batches in flight, for at
  most ``shutdown_timeout``, then cuts them short and gives their rows back. A second
  SIGTERM (or Ctrl-C) does so at once.

A relay that fails for good (a schema that lacks a migration, a broker that refuses its
configuration) stops the others, and ``run`` raises its error once they have finished.

With one ``db`` (no names), the group holds that one relay, made exactly as
``Relay.from_settings`` makes it alone.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING

from outboxer.config import Settings
from outboxer.errors import ConfigError, OutboxerError
from outboxer.redact import get_logger
from outboxer.relay import PublisherPool, RecoveryGate, Relay, RelayStats, metrics_if_installed

if TYPE_CHECKING:
    from outboxer.metrics import Metrics

logger = get_logger("outboxer.relay")


class RelayGroup:
    """The relays of one process, one per database (see the module's docstring)."""

    def __init__(
        self,
        relays: Mapping[str, Relay],
        *,
        pool: PublisherPool | None = None,
        several: bool = True,
    ) -> None:
        """``pool``: the publishers the relays share, closed once every relay has ended.
        ``several``: whether the databases are named (status and the API answer per
        database); False for the one relay of a single ``db``."""
        if not relays:
            raise ConfigError("a relay group needs at least one database")
        self.relays = dict(relays)
        self.pool = pool
        self.several = several

    @classmethod
    def from_settings(cls, settings: Settings) -> RelayGroup:
        if not settings.several_databases:
            relay = Relay.from_settings(settings)
            return cls({relay.database: relay}, several=False)
        pool, gate, metrics = PublisherPool(), RecoveryGate(parks=True), metrics_if_installed()
        relays = {}
        for name, own in settings.database_settings().items():
            try:  # nothing connects yet: a refused setting leaves nothing open
                relays[name] = Relay.from_settings(own, pool=pool, gate=gate, metrics=metrics)
            except ConfigError as exc:
                raise ConfigError(f"database {name}: {exc}") from exc
        return cls(relays, pool=pool)

    @property
    def metrics(self) -> Metrics | None:
        """The metrics the relays share (None without prometheus_client)."""
        return next(iter(self.relays.values())).metrics

    @property
    def stopping(self) -> bool:
        return all(relay.stopping for relay in self.relays.values())

    def stop(self) -> None:
        """Stop every relay: they stop claiming, finish their batches in flight, and end."""
        for relay in self.relays.values():
            relay.stop()

    def force_stop(self) -> None:
        """Stop every relay now: their batches in flight are cut short and given back."""
        for relay in self.relays.values():
            relay.force_stop()

    def signalled(self) -> None:
        """SIGTERM or SIGINT: the first stops the relays, the next one forces them."""
        if any(relay.stopping for relay in self.relays.values()):
            self.force_stop()
        else:
            self.stop()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.signalled)

    def health_problems(self) -> dict[str, list[str]]:
        """Each database's problems (see ``Relay.health_problems``); empty lists when fine."""
        return {name: relay.health_problems() for name, relay in self.relays.items()}

    async def run(self) -> dict[str, RelayStats]:
        """Run every relay until ``stop()`` (or, with ``exit_when_idle``, until each has
        published what was due); return each one's counters."""
        if self.several:
            logger.info(
                "relay process started: databases %s, %d publisher(s) shared",
                ", ".join(self.relays),
                len(self.pool or ()),
            )
        tasks = {
            name: asyncio.create_task(relay.run(), name=f"outboxer-relay-{name}")
            for name, relay in self.relays.items()
        }
        failure: BaseException | None = None
        try:
            pending = set(tasks.values())
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for name, task in tasks.items():
                    if task not in done or task.cancelled() or task.exception() is None:
                        continue
                    if failure is None:
                        failure = self._named(name, task.exception())
                        if pending:
                            logger.error(
                                "database %s: the relay stopped: %s; stopping the others",
                                name,
                                task.exception(),
                            )
                        self.stop()
        finally:
            for task in tasks.values():
                task.cancel()  # a no-op for those done; cancelled from outside, ends the rest
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            if self.pool is not None:
                await self.pool.close()
        if failure is not None:
            raise failure
        return {name: relay.stats for name, relay in self.relays.items()}

    def _named(self, name: str, error: BaseException | None) -> BaseException | None:
        """``error`` naming its database when there are several (the same error type)."""
        if not self.several or not isinstance(error, OutboxerError):
            return error
        try:
            named = type(error)(f"database {name}: {error}")
        except TypeError:  # an error whose constructor takes more than a message
            return error
        named.__cause__ = error
        return named


__all__ = ["RelayGroup"]
