"""A key source that raises a BaseException which is no Exception (a KMS client's own
``asyncio.CancelledError``, ``SystemExit``, ``KeyboardInterrupt``) does so in the fetch's
thread, not the enqueue's: the enqueue gets EnqueueKeyUnavailableError (nothing written),
not that exception re-raised as if its own task had been cancelled or its process told to
exit, past the caller's ``except Exception``."""

from __future__ import annotations

import asyncio

import pytest

from outboxer import Outbox
from outboxer.crypto import EnqueueKeyUnavailableError, KeyRing


class Abort(BaseException):
    """What a KMS client raises that is no Exception."""


def failing(error: BaseException) -> Outbox:
    def kms(key_id: str) -> bytes:
        raise error

    return Outbox(encryption=KeyRing.from_callable(kms, "k1"), key_fetch_timeout=2.0)


@pytest.mark.parametrize("error", [Abort("kms aborted"), SystemExit(3), KeyboardInterrupt()])
def test_enqueue_turns_a_sources_base_exception_into_key_unavailable(
    error: BaseException,
) -> None:
    outbox = failing(error)
    # The connection is never reached: the key comes first.
    with pytest.raises(EnqueueKeyUnavailableError, match="'k1'") as caught:
        outbox.enqueue(object(), "a", {"n": 1})
    assert type(caught.value.__cause__.__cause__) is type(error)  # type: ignore[union-attr]
    with pytest.raises(EnqueueKeyUnavailableError):
        outbox.enqueue_many(object(), [{"topic": "a", "payload": {"n": 1}}])


def test_enqueue_async_is_not_cancelled_by_a_sources_cancelled_error() -> None:
    outbox = failing(asyncio.CancelledError())

    async def main() -> tuple[BaseException | None, int]:
        try:
            await outbox.enqueue_async(object(), "a", {"n": 1})
        except BaseException as exc:  # the test reads it
            task = asyncio.current_task()
            assert task is not None
            return exc, task.cancelling()
        return None, 0

    error, cancelling = asyncio.run(main())
    assert cancelling == 0
    assert isinstance(error, EnqueueKeyUnavailableError), repr(error)
    assert "CancelledError" in str(error)
