"""mkdocs hooks (mkdocs.yml: hooks): the README is the site's landing page, and every page of
docs/design/ and docs/brokers/ is in the nav, in the order mkdocs.yml gives and then by name.

The README is read at build time, never copied: a page that holds the marker (docs/index.md)
is replaced by README.md as a whole. Its links are written for GitHub, relative to the
repository root; on the site they must be relative to docs/, so a link into docs/ loses
that prefix. A link to another file of the repository (``bench/README.md``) has no page on the
site: it becomes its text and the path, so the strict build does not fail on it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.outboxer")

README_MARKER = "<!-- README.md -->"
#: Folder of docs/ -> the nav section that lists all of its pages.
SECTIONS = {"design": "Design", "brokers": "Brokers"}

#: A link or an image: mkdocs checks an image's target too (the strict build failed on the
#: README's screenshot with mkdocs 1.6.1 and Markdown 3.11.3, a clean install of 2026-11-24).
_LINK = re.compile(r"(?P<image>!?)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)


def _nav_paths(entries: list[Any]) -> set[str]:
    found: set[str] = set()
    for entry in entries:
        if isinstance(entry, str):
            found.add(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                found |= _nav_paths(value) if isinstance(value, list) else {value}
    return found


def on_config(config: Any) -> Any:
    """Append each page of a SECTIONS folder that the nav does not list to its section."""
    nav = config["nav"]
    listed = _nav_paths(nav)
    docs = Path(config["docs_dir"])
    for folder, title in SECTIONS.items():
        section = next(
            (entry[title] for entry in nav if isinstance(entry, dict) and title in entry), None
        )
        if section is None:
            raise ValueError(f"mkdocs.yml: the nav needs a {title!r} section for docs/{folder}/")
        for page in sorted((docs / folder).glob("*.md")):
            path = page.relative_to(docs).as_posix()
            if path not in listed:
                section.append(path)
    return config


def site_links(markdown: str) -> str:
    """README links, made to work from docs/index.md (outside fenced code blocks)."""

    def rewrite(match: re.Match[str]) -> str:
        image, text, target = match.group("image"), match.group("text"), match.group("target")
        if _EXTERNAL.match(target):
            return match.group(0)
        if target.startswith("docs/"):
            return f"{image}[{text}]({target.removeprefix('docs/')})"
        if image:
            return match.group(0)  # no page to fall back on: the strict build names it
        log.info("README link to %s is not part of the site: kept as text", target)
        return text if text.strip("`") == target else f"{text} (`{target}`)"

    lines = []
    fenced = False
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        lines.append(line if fenced else _LINK.sub(rewrite, line))
    return "".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if README_MARKER not in markdown:
        return markdown
    readme = Path(config["config_file_path"]).parent / "README.md"
    return site_links(readme.read_text("utf-8"))
