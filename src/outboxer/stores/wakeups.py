"""When the relay's waiting loops wake: the state behind PostgreSQL's ``wait_for_wakeup``.

No database here: ``PostgresStore`` owns the LISTEN connection and the registration
statements, and asks this class what to do. A NOTIFY holds a cluster-wide lock through
the writer's commit, so writers notify only while a relay is registered as idle; a relay
registers only after a quiet spell, and polls quickly while it is busy. Three parts:

* **Nudges**, per destination. A nudge (a NOTIFY, a full batch) wakes one waiting loop of
  the destination, or, if none waits, the next one to wait. A NOTIFY does not say which
  destinations the commit wrote rows for, so it nudges every destination seen.
* **The chase.** For ``CHASE_SECONDS`` after a claim (of any destination) found work, one
  loop of each destination looks again every ``CHASE_POLL`` seconds instead of waiting for
  a NOTIFY; the destination's other loops wait to be nudged, as for a NOTIFY.
* **The registration** as idle listener: when it lapses, whether it is due for renewal
  before a wait, and whether it was made just now (then the relay looks for work once more:
  a writer that committed just before the registration did not notify).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

#: Seconds a listener registration outlives the wait it was made for.
REGISTRATION_MARGIN = 2.0
#: For this long after a claim found work, the relay polls every CHASE_POLL seconds
#: instead of registering for NOTIFYs.
CHASE_SECONDS = 0.05
CHASE_POLL = 0.005


class WakeUps:
    """Nudges, the chase after work, and the idle registration's timing, per relay."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: Per destination: loops waiting for a nudge (each nudge wakes one), and whether a
        #: nudge came that nobody waited for yet (a key for every destination seen).
        self._waiters: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._pending: dict[str, bool] = {}
        #: When a claim last found work; the destinations one of whose loops is chasing.
        self._worked_at = -math.inf
        self._chasing: set[str] = set()
        #: Until when this relay is registered as an idle listener (0: not registered).
        self.registered_until = 0.0

    # ----- nudges ----------------------------------------------------------------------------

    def seen(self, destination: str) -> None:
        """A loop of ``destination`` waits for work: later NOTIFYs nudge it too."""
        self._pending.setdefault(destination, False)

    def reset(self, destination: str) -> None:
        """Forget earlier nudges: the claim that follows sees everything committed so far."""
        self._pending[destination] = False

    def nudge(self, destination: str) -> None:
        """Wake one waiting loop of ``destination``, or the next one to wait."""
        waiters = self._waiters.get(destination)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._pending[destination] = True

    def nudge_all(self) -> None:
        """Nudge every destination seen (a NOTIFY, or LISTEN just began)."""
        for destination in list(self._pending):
            self.nudge(destination)

    async def wait(self, destination: str, timeout: float) -> bool:
        """Wait for a nudge of ``destination`` (True) or the timeout (False)."""
        if self._pending.get(destination):
            self._pending[destination] = False
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(destination, collections.deque())
        waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            return False
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
        return True

    # ----- the chase -------------------------------------------------------------------------

    def worked(self) -> None:
        """A claim found work just now."""
        self._worked_at = self._clock()

    @property
    def busy(self) -> bool:
        """Whether a claim found work less than CHASE_SECONDS ago: poll, do not register."""
        return self._clock() - self._worked_at < CHASE_SECONDS

    async def chase(self, destination: str, timeout: float) -> bool:
        """One loop of the destination looks again shortly (True); its others wait to be
        nudged, as for a NOTIFY, for at most CHASE_SECONDS."""
        if destination in self._chasing:
            return await self.wait(destination, min(timeout, CHASE_SECONDS))
        self._chasing.add(destination)
        try:
            await self.wait(destination, min(timeout, CHASE_POLL))
        finally:
            self._chasing.discard(destination)
        return True

    # ----- the idle registration -------------------------------------------------------------

    @property
    def registered(self) -> bool:
        return self._clock() < self.registered_until

    def registration_due(self, timeout: float) -> bool:
        """Whether to register (again) before a wait of ``timeout``: it would lapse meanwhile."""
        return self._clock() > self.registered_until - timeout

    @staticmethod
    def registration_seconds(timeout: float) -> float:
        """How long to register for before a wait of ``timeout``."""
        return timeout + REGISTRATION_MARGIN

    def registered_for(self, timeout: float) -> None:
        """Record a registration made now for a wait of ``timeout``. The relay counts on it
        for less than the database keeps it, so that it renews it before it lapses there."""
        self.registered_until = self._clock() + timeout + REGISTRATION_MARGIN / 2

    def withdraw(self) -> None:
        """The registration is withdrawn (the relay is busy) or was lost."""
        self.registered_until = 0.0
