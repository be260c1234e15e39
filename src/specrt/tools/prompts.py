"""Prompt files as the benchmarks read them: JSONL lines of plain text, chat messages or
Spec-Bench turns, each with its category."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def load_prompts(
    paths: Sequence[Path],
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
) -> list[dict]:
    """JSONL files; each line has "prompt" (plain text), "messages" (chat), or Spec-Bench's
    "turns" (its first turn becomes a user message, through the chat template, as Spec-Bench
    runs it) with its "category". Lines without a category take their file's name. categories
    keeps only those; per_category keeps the first N of each, so a run fits in an hour here."""
    prompts, taken = [], {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            if "turns" in item:
                item = {"messages": [{"role": "user", "content": item["turns"][0]}], **item}
            item.setdefault("set", Path(path).stem)
            item.setdefault("category", item["set"])
            category = item["category"]
            if categories and category not in categories:
                continue
            if per_category is not None and taken.get(category, 0) >= per_category:
                continue
            taken[category] = taken.get(category, 0) + 1
            prompts.append(item)
    return prompts


def prompt_input(item: dict) -> str | list[dict]:
    """What a loaded prompt line asks the model: its chat messages, else its plain text."""
    return item.get("messages") or item["prompt"]
