"""The app's management commands (``commands/``) and what they share."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from django.core.management.base import CommandError

from outboxer.errors import ConfigError, OutboxerError
from outboxer.redact import redact_text

#: Usage errors exit 2, as ``outboxer``'s do.
EXIT_USAGE = 2


@contextlib.contextmanager
def command_errors() -> Iterator[None]:
    """outboxer's errors as Django ``CommandError``s: a bad setting exits 2, others 1."""
    try:
        yield
    except ConfigError as exc:
        raise CommandError(
            f"configuration error: {redact_text(str(exc))}", returncode=EXIT_USAGE
        ) from exc
    except OutboxerError as exc:
        raise CommandError(redact_text(str(exc))) from exc


def _stop_while_starting(signum: int, frame: object) -> None:
    """SIGTERM before the command's event loop took the signal over: nothing is claimed or
    held yet, so stop as Ctrl-C would, and as cleanly."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def stopped_cleanly() -> Iterator[None]:
    """Around a command that runs until signalled (``outboxer_relay``, ``outboxer_consume``):
    SIGTERM or SIGINT at any moment ends it cleanly (exit 0), as they end ``outboxer relay``.

    The relay and the consumer handle both signals once their event loop runs; before that
    (building the relays or the consumer, starting the HTTP API) SIGTERM's default action
    would kill the process (exit -15) and Ctrl-C would end it with a traceback: an
    orchestrator may stop a process the moment it starts.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    # signal.signal works in the main thread only (call_command may run elsewhere).
    previous = signal.signal(signal.SIGTERM, _stop_while_starting) if main_thread else None
    try:
        yield
    except KeyboardInterrupt:
        return  # a daemon's way to stop: exit 0, as the CLI's daemons do
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
