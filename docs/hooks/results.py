"""MkDocs hook: every `<!-- results: NAME -->` on a page becomes the tables of
`benchmarks/results/NAME.json`, rendered by `benchmarks/render_results.py` under a line naming
the CPU and the date, and `<!-- results-index -->` the list of every results file by CPU kind.
A file that is missing, of an unknown kind or of no recorded machine fails the build."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import render_results  # noqa: E402

MARKER = re.compile(r"^<!-- results: ([\w.\-]+) -->$", re.M)
INDEX = "<!-- results-index -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = MARKER.sub(lambda match: render_results.render(match[1]), markdown)
    return markdown.replace(INDEX, render_results.index())
