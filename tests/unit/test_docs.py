"""The documentation: README links that work on the site, and no reference to a design note
that the repository does not hold."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts/mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_links_are_rewritten_for_the_site() -> None:
    site_links = load_hooks().site_links
    readme = (
        "See [RabbitMQ](docs/brokers/rabbitmq.md) and [the API](#http-api), "
        "[PyPI](https://pypi.org/project/outboxer/), ![logo](docs/logo.png).\n"
        "Figures: [bench notes](bench/README.md), [`bench/README.md`](bench/README.md).\n"
        "```md\n[kept](docs/brokers/rabbitmq.md) inside code\n```\n"
    )
    assert site_links(readme) == (
        "See [RabbitMQ](brokers/rabbitmq.md) and [the API](#http-api), "
        "[PyPI](https://pypi.org/project/outboxer/), ![logo](logo.png).\n"
        "Figures: bench notes (`bench/README.md`), `bench/README.md`.\n"
        "```md\n[kept](docs/brokers/rabbitmq.md) inside code\n```\n"
    )


def test_the_site_nav_lists_every_design_and_broker_page(tmp_path: Path) -> None:
    for page in ("design/index.md", "design/zeta.md", "design/alpha.md", "brokers/kafka.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("# page\n")
    nav: list[object] = [
        {"Home": "index.md"},
        {"Design": ["design/index.md", "design/zeta.md"]},
        {"Brokers": []},
    ]
    load_hooks().on_config({"nav": nav, "docs_dir": str(tmp_path)})
    assert nav[1:] == [
        {"Design": ["design/index.md", "design/zeta.md", "design/alpha.md"]},
        {"Brokers": ["brokers/kafka.md"]},
    ]


def test_every_cited_docs_page_exists() -> None:
    """Comments, docstrings and the README cite design notes by path: each must be a file of
    the repository (the original sketch, outside it, is cited nowhere)."""
    sketch = "DESIGN" + ".md"
    cited = re.compile(r"\bdocs/[\w./-]+\.md\b")
    sources = [ROOT / "README.md", ROOT / "mkdocs.yml"]
    for folder in ("src", "tests", "bench", "scripts", "docs"):
        sources += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sql", ".md")]
    missing = []
    for source in sources:
        text = source.read_text("utf-8")
        name = source.relative_to(ROOT)
        if sketch in text:
            missing.append(f"{name}: cites {sketch}, which is not in the repository")
        for path in cited.findall(text):
            if not (ROOT / path).is_file():
                missing.append(f"{name}: cites {path}, which does not exist")
    assert missing == []
