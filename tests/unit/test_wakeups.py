"""WakeUps: the decisions behind PostgreSQL's wait_for_wakeup, without a database."""

from __future__ import annotations

import asyncio

from outboxer.stores.wakeups import (
    CHASE_SECONDS,
    COVER_SECONDS,
    LISTEN_AGAIN,
    PROBE_EVERY,
    PROBE_SECONDS,
    QUIET_SECONDS,
    RATE_SECONDS,
    REGISTRATION_MARGIN,
    WakeUps,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_nudge_wakes_one_waiting_loop_of_its_destination_only() -> None:
    wakeups = WakeUps()
    first, second = (asyncio.create_task(wakeups.wait("a", 5)) for _ in range(2))
    other = asyncio.create_task(wakeups.wait("b", 0.2))
    await asyncio.sleep(0.01)
    wakeups.nudge("a")
    await asyncio.sleep(0.01)
    assert [first.done(), second.done()] == [True, False], "one nudge, one loop"
    wakeups.reset("a")  # the woken loop's claim began: the next commit needs another loop
    wakeups.nudge("a")
    assert await first is True and await second is True
    assert await other is False, "destination b was not nudged"


async def test_a_nudge_is_left_to_a_woken_loop_whose_claim_has_not_begun() -> None:
    """A burst of commits NOTIFYs once each: the claim of the loop the first one woke takes
    them all (it is sent after they are visible), so the burst wakes one loop, not one per
    commit; a loop held up before its claim stops covering the others after COVER_SECONDS."""
    clock = Clock()
    wakeups = WakeUps(clock)
    first, second = (asyncio.create_task(wakeups.wait("a", 5)) for _ in range(2))
    await asyncio.sleep(0.01)
    for _ in range(4):  # one burst, four NOTIFYs
        wakeups.nudge("a")
    await asyncio.sleep(0.01)
    assert [first.done(), second.done()] == [True, False], "the first claim covers the burst"
    clock.now += COVER_SECONDS + 0.001  # the woken loop never claimed
    wakeups.nudge("a")
    assert await second is True, "no longer covered: another loop wakes"
    wakeups.reset("a")
    wakeups.nudge("a")
    assert await wakeups.wait("a", 0.01) is True, "after a claim began, a nudge counts again"


async def test_a_nudge_nobody_waited_for_wakes_the_next_wait_until_a_reset() -> None:
    wakeups = WakeUps()
    wakeups.nudge("a")
    assert await wakeups.wait("a", 0.01) is True, "kept for the next loop"
    assert await wakeups.wait("a", 0.01) is False, "consumed"
    wakeups.nudge("a")
    wakeups.reset("a")  # a claim now sees what the nudge announced
    assert await wakeups.wait("a", 0.01) is False


async def test_a_notify_nudges_every_destination_seen() -> None:
    wakeups = WakeUps()
    wakeups.seen("a")
    wakeups.seen("b")
    waiting = asyncio.create_task(wakeups.wait("a", 5))
    await asyncio.sleep(0.01)
    wakeups.nudge_all()
    assert await waiting is True
    assert await wakeups.wait("b", 0.01) is True, "b's loop hears of it at its next wait"
    assert await wakeups.wait("c", 0.01) is False, "never seen, never nudged"


async def test_after_work_one_loop_per_destination_chases_the_others_wait_for_a_nudge() -> None:
    clock = Clock()
    wakeups = WakeUps(clock, wake_on_commit_below=0)  # any work is load
    assert not wakeups.busy
    wakeups.worked()
    assert wakeups.busy
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def timed(destination: str) -> tuple[bool, float]:
        woken = await wakeups.chase(destination, 30)
        return woken, loop.time() - started

    chaser, other, elsewhere = await asyncio.gather(timed("a"), timed("a"), timed("b"))
    assert chaser[0] is True, "no nudge, yet it looks again (after its busy poll)"
    assert elsewhere[0] is True, "each destination has its own chaser"
    assert other[0] is False and other[1] >= CHASE_SECONDS * 0.9, "waited for a nudge"
    nudged = asyncio.create_task(wakeups.chase("a", 30))
    second = asyncio.create_task(wakeups.chase("a", 30))
    await asyncio.sleep(0)
    wakeups.nudge("a")  # each nudge wakes one waiting loop, the first to wait first
    wakeups.reset("a")  # (its claim began)
    wakeups.nudge("a")
    assert await nudged is True and await second is True
    clock.now += CHASE_SECONDS + 0.001
    assert not wakeups.busy, "quiet: register and wait for a NOTIFY"


async def test_the_chase_looks_again_after_the_configured_busy_poll() -> None:
    loop = asyncio.get_running_loop()
    timings = {}
    for busy_poll in (0.002, 0.03):
        wakeups = WakeUps(wake_on_commit_below=0, busy_poll=busy_poll)
        wakeups.worked()
        started = loop.time()
        assert await wakeups.chase("a", 30) is True
        timings[busy_poll] = loop.time() - started
    # A timer never fires early; it may fire late on a busy box, so only the long one is
    # bounded from below, and the short one must not wait as long.
    assert timings[0.03] >= 0.03 * 0.95
    assert timings[0.002] < 0.03
    wakeups = WakeUps(wake_on_commit_below=0, busy_poll=0.03)
    wakeups.worked()
    started = loop.time()
    assert await wakeups.chase("a", 0.002) is True, "a shorter wait asked for wins"
    assert loop.time() - started < 0.03


def test_the_registration_is_renewed_before_it_lapses_and_withdrawn_when_busy() -> None:
    clock = Clock()
    wakeups = WakeUps(clock)
    assert not wakeups.registered and wakeups.registration_due(1.0)
    assert wakeups.registration_seconds(1.0) == 1.0 + REGISTRATION_MARGIN
    wakeups.registered_for(1.0)
    assert wakeups.registered
    assert not wakeups.registration_due(1.0), "it outlasts the next wait"
    clock.now += REGISTRATION_MARGIN / 2 + 0.01
    assert wakeups.registered and wakeups.registration_due(1.0), "it would lapse in the wait"
    clock.now += 1.0
    assert not wakeups.registered
    wakeups.registered_for(1.0)
    wakeups.withdraw()
    assert not wakeups.registered and wakeups.registration_due(1.0)


def test_the_relay_chases_only_while_it_claims_at_the_threshold_or_more() -> None:
    clock = Clock()
    wakeups = WakeUps(clock, wake_on_commit_below=300)
    for _ in range(100):  # 200 messages/s, one a claim
        clock.now += 0.005
        wakeups.worked(1)
    assert 150 < wakeups.rate < 250
    assert not wakeups.busy, "200/s: keep listening, each commit wakes the relay"
    for _ in range(40):  # 1,000 messages/s, five a claim
        clock.now += 0.005
        wakeups.worked(5)
    assert wakeups.rate > 800 and wakeups.busy, "under load: poll, writers skip the NOTIFY"
    clock.now += CHASE_SECONDS + 0.001
    assert not wakeups.busy, "quiet: register and wait for a NOTIFY"


def test_a_rate_near_the_threshold_does_not_flap_between_listening_and_polling() -> None:
    clock = Clock()
    wakeups = WakeUps(clock, wake_on_commit_below=300)
    wakeups.worked(int(300 * RATE_SECONDS) + 1)  # a burst: load at once
    assert wakeups.busy
    # Falls to just under the threshold, above LISTEN_AGAIN of it: still load.
    for _ in range(50):  # 240 messages/s
        clock.now += 0.0125
        wakeups.worked(3)
    assert 300 * LISTEN_AGAIN < wakeups.rate < 300
    assert wakeups.busy, "within the margin: keep polling"
    for _ in range(50):  # 160 messages/s
        clock.now += 0.0125
        wakeups.worked(2)
    assert wakeups.rate < 300 * LISTEN_AGAIN and not wakeups.busy, "well below: listen again"


def test_a_listening_relay_at_work_polls_for_a_spell_now_and_then() -> None:
    """Writers held under the threshold by their own NOTIFYs (they wait for each other)
    would keep the relay listening for ever: a spell of polling shows their real rate."""
    clock = Clock()
    wakeups = WakeUps(clock, wake_on_commit_below=300)
    busy = []
    for _ in range(int(2 * PROBE_EVERY / 0.005)):  # 200 messages/s for two probe periods
        clock.now += 0.005
        wakeups.worked(1)
        busy.append(wakeups.busy)
    polled = sum(busy) * 0.005
    assert 1.5 * PROBE_SECONDS <= polled <= 2.5 * PROBE_SECONDS, "one spell a period"
    assert not busy[-1], "listening between the spells"
    # During a spell the writers, no longer notifying, commit at 1,000/s: load.
    wakeups = WakeUps(clock, wake_on_commit_below=300)
    for _ in range(20):
        clock.now += 0.005
        wakeups.worked(1)
    assert wakeups.busy, "a spell began"
    for _ in range(40):
        clock.now += 0.005
        wakeups.worked(5)
    clock.now += PROBE_SECONDS
    wakeups.worked(5)
    assert wakeups.busy, "past the spell: under load, polling on"


def test_a_trickle_is_never_probed() -> None:
    clock = Clock()
    wakeups = WakeUps(clock, wake_on_commit_below=300)
    for _ in range(100):  # 20 messages/s
        clock.now += 0.05
        wakeups.worked(1)
        assert not wakeups.busy


async def test_a_destination_is_quiet_until_its_claims_find_work_and_again_after() -> None:
    clock = Clock()
    wakeups = WakeUps(clock)
    wakeups.seen("busy")
    assert not wakeups.several_destinations, "one destination: nobody asks before claiming"
    wakeups.seen("other")
    assert wakeups.several_destinations
    assert wakeups.quiet("busy") and wakeups.quiet("other"), "never worked"
    wakeups.worked(3, "busy")
    assert not wakeups.quiet("busy") and wakeups.quiet("other")
    clock.now += QUIET_SECONDS
    assert wakeups.quiet("busy")


async def test_going_busy_nudges_the_quiet_destinations_only() -> None:
    clock = Clock()
    wakeups = WakeUps(clock)
    for destination in ("busy", "quiet"):
        wakeups.seen(destination)
    wakeups.worked(1, "busy")
    busy, quiet = (asyncio.create_task(wakeups.wait(d, 5)) for d in ("busy", "quiet"))
    await asyncio.sleep(0.01)
    wakeups.nudge_quiet()  # the relay withdrew its registration: no NOTIFY comes now
    assert await asyncio.wait_for(quiet, 1) is True
    assert not busy.done(), "a busy destination chases by itself"
    busy.cancel()


def test_chases_on_the_tick_end_at_the_same_instant() -> None:
    """The chases of quiet destinations, begun at different times, end at the same instant
    (in one turn of the event loop): their loops then ask the database one question, not one
    each. Without ``on_tick``, each ends busy_poll after it began."""
    wakeups = WakeUps(busy_poll=0.05)
    begun = [1000.001, 1000.013, 1000.029, 1000.049]
    on_tick = {round(now + wakeups.chase_delay(now, on_tick=True), 9) for now in begun}
    assert on_tick == {1000.05}
    alone = {round(now + wakeups.chase_delay(now, on_tick=False), 9) for now in begun}
    assert len(alone) == len(begun)
