"""One yes/no parser for every option written as text."""

from __future__ import annotations

import pytest

from outboxer.brokers.base import option_bool
from outboxer.errors import ConfigError
from outboxer.options import FALSE_WORDS, TRUE_WORDS, parse_bool


@pytest.mark.parametrize("word", [*TRUE_WORDS, "TRUE", " Yes ", "On"])
def test_true_words(word: str) -> None:
    assert parse_bool(word, "flag") is True


@pytest.mark.parametrize("word", [*FALSE_WORDS, "False", " NO", "off\n"])
def test_false_words(word: str) -> None:
    assert parse_bool(word, "flag") is False


@pytest.mark.parametrize("word", ["", " ", "2", "maybe", "y", "n", "truthy", "nein"])
def test_anything_else_is_a_config_error_naming_the_option(word: str) -> None:
    with pytest.raises(ConfigError, match=r"^flag must be true or false .*, not "):
        parse_bool(word, "flag")


def test_adapter_options_keyword_then_url_query_then_default() -> None:
    assert option_bool({"tls": "off"}, "tls", True, False) is True
    assert option_bool({"tls": "ON"}, "tls", None, False) is True
    assert option_bool({"tls": " "}, "tls", None, True) is True  # blank: the default
    assert option_bool({}, "tls", None, False) is False
    with pytest.raises(ConfigError, match=r"^tls must be true or false"):
        option_bool({"tls": "sometimes"}, "tls", None, False)
