"""When the relay's waiting loops wake: the state behind PostgreSQL's ``wait_for_wakeup``.

No database here: ``PostgresStore`` owns the LISTEN connection and the registration
statements, and asks this class what to do. A NOTIFY holds a cluster-wide lock through
the writer's commit, so writers notify only while a relay is registered as idle
listener. Under load a relay polls instead: then nobody notifies, and notifying commits
do not wait for each other. Four parts:

* **Nudges**, per destination. A nudge (a NOTIFY, a full batch) wakes one waiting loop of
  the destination, or, if none waits, the next one to wait. A NOTIFY does not say which
  destinations the commit wrote rows for, so it nudges every destination seen. A nudge
  while a loop it woke has not begun its claim yet is left to that claim (a burst of
  commits wakes one loop, not one per commit).
* **The claim rate**: messages claimed per second, a moving average over about
  ``RATE_SECONDS``. At ``wake_on_commit_below`` messages/s or more the relay is under
  load and chases (below); it goes back to listening once the rate falls under
  ``LISTEN_AGAIN`` of that (a margin, so that a rate near the threshold does not
  register and withdraw at every claim). Below it, a claim that finds work keeps the
  registration, and each commit wakes the relay at once: at 200 commits/s, a commit is
  published a claim after it, not half a poll later. Notifying commits wait for each
  other, though: writers able to commit faster than the threshold can be held under it
  by their own NOTIFYs. So a relay that works while listening, at a quarter of the
  threshold or more, polls for ``PROBE_SECONDS`` every ``PROBE_EVERY`` seconds: without
  NOTIFYs such writers speed up past the threshold, and the relay stays under load.
* **The chase**, under load only. For ``CHASE_SECONDS`` after a claim (of any
  destination) found work, one loop of each destination looks again every
  ``busy_poll`` seconds (the ``busy_poll_interval`` setting) instead of waiting for a
  NOTIFY; the destination's other loops wait to be nudged, as
  for a NOTIFY. The poll sets both the latency and the CPU per message under load: a
  commit waits half a poll for its claim on average, and every claim costs the relay
  about a millisecond of CPU, whatever it takes.
* **The registration** as idle listener: when it lapses, whether it is due for renewal
  before a wait, and whether it was made just now (then the relay looks for work once more:
  a writer that committed just before the registration did not notify).
* **Quiet destinations**, in a relay of several: one none of whose claims found work for
  ``QUIET_SECONDS``. A NOTIFY does not say which destinations it is for, and the chase
  ran for every destination alike: with one destination busy, each of the others claimed
  every ``busy_poll`` seconds and at every NOTIFY, finding nothing. Woken, a loop of a
  quiet destination first asks, with the other quiet destinations woken at the same time,
  one cheap read-only question (``PostgresStore``: which of them have a row due), and
  claims only if its destination has; their chases poll on shared ticks, so that the
  question is asked once a tick for all of them.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

from outboxer.config import Settings

#: Seconds a listener registration outlives the wait it was made for.
REGISTRATION_MARGIN = 2.0
#: For this long after a claim found work, a relay under load polls every ``busy_poll``
#: seconds instead of registering for NOTIFYs.
CHASE_SECONDS = 0.05
#: Time constant of the claim rate's moving average: short, so that a relay goes from
#: listening to polling a few claims into a burst (each commit notifies meanwhile).
RATE_SECONDS = 0.1
#: Under load, the relay listens again once its claim rate falls below this share of
#: ``wake_on_commit_below``.
LISTEN_AGAIN = 0.8
#: While it listens and works at a quarter of the threshold or more, the relay polls for
#: PROBE_SECONDS every PROBE_EVERY seconds: notifying commits wait for each other, so
#: writers that could commit faster than the threshold may be held under it by the
#: NOTIFYs themselves, and only a spell without them shows their real rate.
PROBE_EVERY = 1.0
PROBE_SECONDS = 0.1
#: For at most this long after a nudge woke a loop (or was kept for the next wait), further
#: nudges of the destination are left to that loop's claim, which has not begun yet.
COVER_SECONDS = 0.05
#: A destination none of whose claims found work for this long is quiet (see the module doc).
#: Short: a destination that is not quiet claims at every NOTIFY for the others (at 100
#: commits/s for one destination, a second of that was 100 claims of another that had
#: published one row); one that is asks first, a round trip more before its claim, which
#: a destination of more than 10 messages a second never pays.
QUIET_SECONDS = 0.1


class WakeUps:
    """Nudges, the chase after work, and the idle registration's timing, per relay."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        wake_on_commit_below: float = Settings.wake_on_commit_below,
        busy_poll: float = Settings.busy_poll_interval,
    ) -> None:
        self._clock = clock
        #: Messages/s claimed from which the relay polls (chases) instead of listening.
        self.wake_on_commit_below = wake_on_commit_below
        #: How soon a chasing loop looks again (the ``busy_poll_interval`` setting).
        self.busy_poll = busy_poll
        #: The claim rate's moving average, as of ``_rate_at``; whether it means load.
        self._rate = 0.0
        self._rate_at = clock()
        self._loaded = False
        #: The probe in progress polls until ``_probe_until``; the next one starts then.
        self._probe_until = -math.inf
        self._next_probe = -math.inf
        #: Per destination: loops waiting for a nudge (each nudge wakes one), and whether a
        #: nudge came that nobody waited for yet (a key for every destination seen).
        self._waiters: dict[str, collections.deque[asyncio.Future[bool]]] = {}
        self._pending: dict[str, bool] = {}
        #: Per destination: until when a nudge already delivered (a loop woken, or one kept
        #: for the next wait) covers later ones, see nudge.
        self._covered_until: dict[str, float] = {}
        #: When a claim last found work (of any destination, and per destination); the
        #: destinations one of whose loops is chasing.
        self._worked_at = -math.inf
        self._destination_worked_at: dict[str, float] = {}
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
        self._covered_until[destination] = -math.inf

    def nudge(self, destination: str) -> None:
        """Wake one waiting loop of ``destination``, or the next one to wait.

        Not if a nudge delivered since the destination's last claim began is still to be
        acted on (for at most COVER_SECONDS): the claim of the loop it woke is yet to be
        sent, so it takes what this nudge announces (a NOTIFY comes after its commit is
        visible). A burst of commits (writers that commit together, a request that fans
        out) sent a NOTIFY each, and each woke a loop: the first claim took every row, the
        others found nothing (at 200 commits/s in bursts of four, 150 claims a second
        found nothing, bench/paced_relay.py --in-phase). The bound keeps a woken loop that
        is held up before its claim (a broker reconnect, the recovery gate) from keeping
        the others asleep.
        """
        now = self._clock()
        if now < self._covered_until.get(destination, -math.inf):
            return
        self._covered_until[destination] = now + COVER_SECONDS
        waiters = self._waiters.get(destination)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._pending[destination] = True

    def nudge_all(self) -> None:
        """Nudge every destination seen (a NOTIFY, or LISTEN just began)."""
        for destination in list(self._pending):
            self.nudge(destination)

    def nudge_quiet(self) -> None:
        """Nudge the quiet destinations: their loops waiting for a NOTIFY that will not come
        (the relay is busy and withdrew its registration) go and chase."""
        for destination in list(self._pending):
            if self.quiet(destination):
                self.nudge(destination)

    async def wait(self, destination: str, timeout: float) -> bool:
        """Wait for a nudge of ``destination`` (True) or the timeout (False)."""
        if self._pending.get(destination):
            self._pending[destination] = False
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        waiters = self._waiters.setdefault(destination, collections.deque())
        waiters.append(waiter)
        # A timer, not wait_for: the chase waits after nearly every claim, and this is the
        # cheapest timeout there is (one timer handle).
        timer = loop.call_later(timeout, _time_out, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            if waiter in waiters:
                waiters.remove(waiter)

    # ----- the chase -------------------------------------------------------------------------

    def worked(self, messages: int = 1, destination: str | None = None) -> None:
        """A claim (of ``destination``) took ``messages`` just now."""
        now = self._worked_at = self._clock()
        if destination is not None:
            self._destination_worked_at[destination] = now
        # Each claim adds messages / RATE_SECONDS to an average that decays with time
        # constant RATE_SECONDS: its expected value is the claim rate.
        self._rate = self.rate + messages / RATE_SECONDS
        self._rate_at = now
        if self._rate >= self.wake_on_commit_below:
            self._loaded = True
        elif self._rate < self.wake_on_commit_below * LISTEN_AGAIN:
            self._loaded = False
        if (
            not self._loaded
            and self._rate >= self.wake_on_commit_below / 4
            and now >= self._next_probe
        ):
            self._probe_until = now + PROBE_SECONDS
            self._next_probe = now + PROBE_EVERY

    @property
    def rate(self) -> float:
        """Messages claimed per second, lately (a moving average)."""
        return self._rate * math.exp((self._rate_at - self._clock()) / RATE_SECONDS)

    @property
    def busy(self) -> bool:
        """Whether the relay is under load (or probing for it) and a claim found work less
        than CHASE_SECONDS ago: poll, do not register (and withdraw a registration)."""
        now = self._clock()
        return (self._loaded or now < self._probe_until) and now - self._worked_at < CHASE_SECONDS

    async def chase(self, destination: str, timeout: float, *, on_tick: bool = False) -> bool:
        """One loop of the destination looks again shortly (True); its others wait to be
        nudged, as for a NOTIFY, for at most CHASE_SECONDS. ``on_tick``: the look comes
        at the next multiple of ``busy_poll`` on the loop's clock, when the chases of all
        quiet destinations end, in one turn of the event loop."""
        if destination in self._chasing:
            return await self.wait(destination, min(timeout, CHASE_SECONDS))
        self._chasing.add(destination)
        delay = self.chase_delay(asyncio.get_running_loop().time(), on_tick=on_tick)
        try:
            await self.wait(destination, min(timeout, delay))
        finally:
            self._chasing.discard(destination)
        return True

    def chase_delay(self, now: float, *, on_tick: bool) -> float:
        """Seconds from ``now`` (the event loop's clock) to the chase's next look."""
        if on_tick:
            return self.busy_poll - now % self.busy_poll
        return self.busy_poll

    # ----- quiet destinations ----------------------------------------------------------------

    @property
    def several_destinations(self) -> bool:
        """Whether loops of more than one destination wait here."""
        return len(self._pending) > 1

    def quiet(self, destination: str) -> bool:
        """No claim of ``destination`` found work for QUIET_SECONDS (or ever)."""
        worked_at = self._destination_worked_at.get(destination, -math.inf)
        return self._clock() - worked_at >= QUIET_SECONDS

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


def _time_out(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
