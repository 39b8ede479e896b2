"""The docs as a reader finds them: every relative link lands on a page and a heading
that exist, and no page is too long to read (issue 53: a reference, not a log)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
#: a page over this is split: the current figures in a reference, history in the notebook
MAX_PAGE_BYTES = 30_000

_LINK = re.compile(r"\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings (lowercased; punctuation but ``-`` and
    ``_`` dropped; spaces as ``-``; a repeated heading gets ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_FENCE.sub("", page.read_text()))
            if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: are not checked here


def test_the_link_checker_sees_links_and_headings() -> None:
    readme = ROOT / "README.md"
    assert "docs/performance.md" in {t.partition("#")[0] for t in links(readme)}
    assert "current-figures" in anchors(ROOT / "docs" / "performance.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_is_over_30_kb(page: Path) -> None:
    assert page.stat().st_size <= MAX_PAGE_BYTES, \
        f"{page.relative_to(ROOT)}: {page.stat().st_size:,} bytes"
