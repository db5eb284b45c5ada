"""The README's framework examples, run as they are written (only the database URL swapped)."""

from __future__ import annotations

import json
import pathlib
import re
import sys
import types

from tests.contrib.helpers import claim_all, sqlalchemy_url

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_example(name: str) -> str:
    """The fenced code block that follows ``<!-- example: NAME ... -->`` in the README."""
    match = re.search(
        rf"<!-- example: {re.escape(name)}\b[^>]*-->\n```\w*\n(.*?)\n```", README.read_text(), re.S
    )
    assert match, f"README has no example {name!r}"
    return match.group(1)


def run_example(name: str, replacements: dict[str, str]) -> dict[str, object]:
    code = readme_example(name)
    for old, new in replacements.items():
        assert old in code, f"the {name} example no longer contains {old!r}"
        code = code.replace(old, new)
    # A module of its own: SQLAlchemy resolves annotations through sys.modules.
    module = types.ModuleType(f"readme_{name.replace('-', '_')}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, f"README.md:{name}", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


def test_sqlalchemy_example(pg_url: str) -> None:
    namespace = run_example(
        "sqlalchemy", {"postgresql+psycopg://localhost/app": sqlalchemy_url(pg_url)}
    )
    engine = namespace["engine"]
    [message] = claim_all(pg_url)
    assert (message.topic, message.key) == ("order.placed", "customer-7")
    assert json.loads(message.payload) == {"id": 1}
    engine.dispose()  # type: ignore[attr-defined]
