"""README.md's figures are rendered from docs/figures.json (``bench.readme``), never
typed by hand."""

from __future__ import annotations

import json
import re

from bench import readme


def test_the_readme_says_what_the_recorded_runs_measured() -> None:
    """Every figures block of README.md is what docs/figures.json renders (a number
    edited by hand, or a run recorded without rewriting README.md, fails here)."""
    assert readme.main(["--check"]) == 0


def test_every_block_has_its_run_and_every_run_names_its_command() -> None:
    text = readme.README.read_text()
    figures = json.loads(readme.FIGURES.read_text())
    assert sorted(readme.blocks(text)) == sorted(readme.BLOCKS)
    assert sorted(figures) == sorted(readme.SOURCES)
    for name, (command, _, _) in readme.SOURCES.items():
        assert figures[name]["command"] == command and figures[name]["measured"]


def test_a_hand_edited_figure_is_caught() -> None:
    text = readme.README.read_text()
    figures = json.loads(readme.FIGURES.read_text())
    block = re.search(r"<!-- figures:demo -->\n(.*?)\n<!-- /figures -->", text, re.DOTALL)
    assert block is not None
    edited = text.replace(block.group(1), re.sub(r"\d+ ms cold", "1 ms cold", block.group(1)))
    assert edited != text and readme.render(edited, figures) != edited
    assert readme.render(text, figures) == text
