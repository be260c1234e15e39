# ruff: noqa: E501 (the documents and requests are data: their lines are paragraphs)
"""Writes predicted_files.jsonl: editor-style requests over whole files, each sending the file
as its prediction (what code-editing clients send with OpenAI's Predicted Outputs).

The files are functions and sections of CPython 3.11's standard library (read from the running
interpreter, so run it with 3.11 to reproduce the committed set; two carry a planted bug to
fix) and two short documents; the system prompt asks for the whole file and nothing else, as
OpenAI's example of the feature does. Usage: python make_predicted_files.py OUT.jsonl
"""

import colorsys
import difflib
import gettext
import heapq
import inspect
import json
import statistics
import sys
import textwrap

SYSTEM = (
    "You edit files. Apply the change the user asks for and reply with the complete "
    "updated file and nothing else: no explanation, no Markdown fences."
)


def section(module, start, end=None):
    s = inspect.getsource(module)
    a = s.index(start)
    b = s.index(end, a) if end else len(s)
    return s[a:b].rstrip() + "\n"


def src(f):
    return inspect.getsource(f).rstrip() + "\n"


colorsys_hls = "ONE_THIRD = 1.0/3.0\nONE_SIXTH = 1.0/6.0\nTWO_THIRD = 2.0/3.0\n\n\n" + section(
    colorsys, "# HLS", "# HSV"
)
colorsys_hsv = section(colorsys, "# HSV").replace("    i = i%6\n", "    i = i%5\n")
colorsys_yiq = section(colorsys, "# YIQ", "# HLS")
dedent = src(textwrap.dedent).replace("margin = margin[:i]\n", "margin = margin[:i + 1]\n")
assert "i%5" in colorsys_hsv and "[:i + 1]" in dedent

DOC_RELEASE = """Lantern 4.2 release notes

Lantern 4.2 is the second feature release of the 4.x series. It was published on 14 March 2026 and is supported until the end of September 2027.

The headline change is a new query planner. On the project's benchmark suite, which runs 310 queries against a 40 GB dataset, the median query now finishes 27 percent faster than in 4.1. Queries that join more than five tables benefit most, because the planner now considers bushy join trees instead of only left-deep ones.

The storage engine gained online compaction: tables no longer need to be taken offline to reclaim space, and compaction runs at a lower I/O priority than user queries. The write-ahead log is now checksummed with CRC32C, and a damaged log segment is reported with its file name and offset instead of stopping the server.

Two features were removed. The legacy XML export, deprecated since 3.6, is gone; use the JSON or Parquet exporters instead. The `--unsafe-fsync` flag was removed as well, since it could lose committed transactions after a power failure.

This release contains 412 commits from 57 contributors, 19 of them first-time contributors. Thanks to everyone who reported bugs during the two release candidates.
"""

DOC_CITY = """Port Alder

Port Alder is a harbour city on the northern bank of the Sella river, about 40 kilometres from the open sea. With a population of 2.1 million, it is the third largest city in the region and its busiest port by tonnage.

The city grew around a fishing village first recorded in 1284. Its fortunes changed in the nineteenth century, when the river was dredged and the first steam ferries linked it to the islands. The old town still keeps the shape of the medieval walls, although only the Salt Gate survives.

Port Alder is governed by a council of 45 members elected every four years. The current mayor, Ana Ruiz, was elected in 2019 on a promise to extend the tram network to the harbour district; the extension opened in 2023 and carries about 60,000 passengers a day.

The city hosts a university founded in 1874, a maritime museum with the largest collection of ship models in the country, and the annual Alder Light Festival, which draws visitors from across the country every December. Its football club, Sella United, plays at the Riverside Stadium, which holds 31,000 spectators.
"""

rows = [
    (
        "rename",
        "python",
        colorsys_hls,
        "Rename the helper function `_v` to `_hue_to_channel` everywhere, including every call.",
    ),
    (
        "rename",
        "python",
        src(difflib.get_close_matches),
        "Rename the parameter `possibilities` to `candidates` everywhere in this function, in the docstring too.",
    ),
    (
        "rename",
        "python",
        src(heapq.nsmallest),
        "Rename the local variable `result` to `best` everywhere in this function.",
    ),
    (
        "parameter",
        "python",
        src(statistics.mode),
        "Add a keyword-only parameter `default=None`. When data is empty and a default is given, return it instead of raising StatisticsError. Say so in the docstring.",
    ),
    (
        "parameter",
        "python",
        src(textwrap.indent),
        "Add a parameter `keepends=True` after `predicate`, and pass it to `splitlines` instead of the literal True.",
    ),
    (
        "fix",
        "python",
        dedent,
        "When two indents differ, this function keeps one character too many of the common margin. Fix that one line.",
    ),
    (
        "fix",
        "python",
        colorsys_hsv,
        "hsv_to_rgb returns None for hues in the last sixth of the circle. Fix the line that wraps the sector index.",
    ),
    (
        "type_hints",
        "python",
        colorsys_yiq,
        "Add type hints to both functions: every parameter is a float and each returns a tuple of three floats.",
    ),
    (
        "type_hints",
        "python",
        src(gettext.c2py),
        "Add type hints: `plural` is a str and the function returns a Callable[[int], int]. Import Callable from typing at the top.",
    ),
    (
        "constant",
        "python",
        src(gettext.c2py).replace("def c2py", "def compile_plural"),
        "Raise the nesting limit from 20 to 32 and update the comment above it to match.",
    ),
    (
        "document",
        "text",
        DOC_RELEASE,
        "Update two facts: the release was published on 2 April 2026, and it contains 436 commits from 61 contributors. Change nothing else.",
    ),
    (
        "document",
        "text",
        DOC_CITY,
        "Update two facts: the population is now 2.3 million, and the current mayor is Tomas Berg, elected in 2024. Change nothing else.",
    ),
]

with open(sys.argv[1], "w") as out:
    for category, lang, text, ask in rows:
        fence = "```python" if lang == "python" else "```"
        user = f"{ask}\n\n{fence}\n{text}```"
        item = {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "prediction": text,
            "category": category,
        }
        out.write(json.dumps(item) + "\n")
