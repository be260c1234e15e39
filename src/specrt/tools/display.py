"""How `specrt generate` shows a result: its statistics, and which tokens the drafts made.

Desktop tools colour the text a draft or a prediction supplied, so a user can see where the
speed came from; `--show-accepted` does the same. Colours are ANSI styles that click drops when
the output is not a terminal, so a pipe or a file gets plain text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import click

from specrt.runtime.text import IncrementalDecoder, TextTokenizer

STYLES = {"draft": {"fg": "green"}, "prediction": {"fg": "cyan"}, "target": {}}
LEGEND = "green: accepted from the draft, cyan: from the prediction, plain: the target's own"


def format_stats(s, finish_reason: str) -> str:
    return (
        f"{s.new_tokens} tokens in {s.total_seconds:.2f}s ({s.tokens_per_second:.1f} tok/s), "
        f"first token {s.ttft_seconds * 1000:.0f} ms, finish: {finish_reason}\n"
        f"rounds {s.rounds}, drafted {s.drafted}, accepted {s.accepted} "
        f"({s.acceptance_rate:.0%}), {s.tokens_per_target_call:.2f} tokens per target call\n"
        f"draft {s.draft_seconds:.2f}s, verify {s.verify_seconds:.2f}s, "
        f"prefill {s.prefill_seconds:.2f}s{_cached(s)}, controller {s.controller}, "
        f"drafter {s.drafter}" + _prediction_line(s)
    )


def _cached(s) -> str:
    if not s.cached_tokens:
        return ""
    return f" ({s.cached_tokens} of {s.prompt_tokens} prompt tokens cached)"


def _prediction_line(s) -> str:
    if s.drafter != "prediction":
        return ""
    return (
        f"\nprediction tokens accepted {s.accepted_prediction_tokens}, "
        f"rejected {s.rejected_prediction_tokens}"
    )


def json_result(result) -> str:
    """The result as one JSON line: text, ids, who made each token, statistics."""
    return json.dumps(
        {
            "text": result.text,
            "token_ids": result.token_ids,
            "token_origins": result.stats.token_origins,  # draft, prediction, target
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
        }
    )


def accepted_text(tokenizer: TextTokenizer, result) -> str:
    """The result's text with the runs each origin made styled apart."""
    runs = pieces(tokenizer, result.token_ids, result.stats.token_origins, result.text)
    return "".join(click.style(text, **STYLES.get(origin, {})) for origin, text in runs)


def pieces(
    tokenizer: TextTokenizer, token_ids: Sequence[int], origins: Sequence[str], text: str
) -> list[tuple[str, str]]:
    """The output text cut into runs made by one origin each: [(origin, text), ...]. A token
    that completes a multi-byte character carries it; the runs stop where the result's text
    does (a stop string is cut)."""
    decoder, runs, shown = IncrementalDecoder(tokenizer), [], 0
    for token, origin in zip(token_ids, origins, strict=True):
        piece = decoder.push(token)[: max(0, len(text) - shown)]
        shown += len(piece)
        if not piece:
            continue
        if runs and runs[-1][0] == origin:
            runs[-1] = (origin, runs[-1][1] + piece)
        else:
            runs.append((origin, piece))
    return runs
