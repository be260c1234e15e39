"""MkDocs hook: every `<!-- results: NAME -->` on a page becomes the tables of
`benchmarks/results/NAME.json`, rendered by `benchmarks/render_results.py` under a line naming
the CPU and the date, and `<!-- results-index -->` the list of every results file by CPU kind.
A marker indented under a list item is rendered at its indent, so the tables stay in the item,
with its headings as bold lines (a heading cannot open a line there; matched only at the
margin, every marker in limits.md and precision.md had stayed unrendered).
A file that is missing, of an unknown kind or of no recorded machine fails the build."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import render_results  # noqa: E402

MARKER = re.compile(r"^( *)<!-- results: ([\w.\-]+) -->$", re.M)
HEADING = re.compile(r"^#+ (.+)$", re.M)
INDEX = "<!-- results-index -->"


def _render(match: re.Match) -> str:
    indent, text = match[1], render_results.render(match[2])
    if indent:
        text = textwrap.indent(HEADING.sub(r"**\1**", text), indent)
    return text


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(_render, markdown).replace(INDEX, render_results.index())
