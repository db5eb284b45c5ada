"""The app's management commands (``commands/``) and what they share."""

from __future__ import annotations

import contextlib
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
