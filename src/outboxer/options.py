"""Option values written as text (URL queries, environment, files), parsed one way everywhere."""

from __future__ import annotations

from outboxer.errors import ConfigError

#: The spellings of yes and no, compared without regard to case or surrounding space.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(text: str, name: str) -> bool:
    """``text`` as a yes/no option called ``name``; ConfigError for any other word."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"{name} must be true or false (or 1/0, yes/no, on/off), not {text!r}")


__all__ = ["FALSE_WORDS", "TRUE_WORDS", "parse_bool"]
