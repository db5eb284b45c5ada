"""One parser for yes/no values, shared by settings and publisher options."""

from __future__ import annotations

from outboxer.errors import ConfigError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str | bool, name: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case, spaces
    around ignored); a bool passes through. Anything else is a ConfigError naming ``name``."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name} must be true or false (yes/no, on/off, 1/0); got {text!r}")
