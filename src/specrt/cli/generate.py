"""`specrt generate`: one prompt through a bundle, with speculation or without."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specrt.cli.common import log as _log
from specrt.engines import BACKENDS
from specrt.runtime.drafters import DRAFT_WINDOW, DRAFTERS


def _structure(json_schema: Path | None, grammar: Path | None, regex: str | None):
    from specrt.runtime.grammar import Structure, load_structure

    given = [g for g in (json_schema, grammar, regex) if g is not None]
    if len(given) > 1:
        raise click.UsageError("give one of --json-schema, --grammar, --regex")
    if regex is not None:
        return Structure("regex", regex)
    if given:
        return load_structure("json_schema" if json_schema else "lark", str(given[0]))
    return None


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message via the chat template.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, help="1 = off.")
@click.option(
    "--min-p", default=0.0, show_default=True, help="Keep tokens at least this share of the best."
)
@click.option("--seed", type=int, default=None, help="Make sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--controller", default="adaptive", show_default=True, help="fixed:K | heuristic | adaptive"
)
@click.option(
    "--drafter",
    type=click.Choice(DRAFTERS),
    default=None,
    help="Who drafts: the draft model, a lookup in the context (ngram), or both (hybrid) "
    "[default: model, or ngram for a bundle without a draft model].",
)
@click.option("--no-speculation", is_flag=True, help="Run the target alone (same engine).")
@click.option(
    "--backend",
    default="onnxruntime",
    show_default=True,
    type=click.Choice(BACKENDS),
    help="onnxruntime (CPU), onnxruntime-cuda, onnxruntime-tensorrt, tensorrt or torch.",
)
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores).")
@click.option(
    "--draft-window",
    default=DRAFT_WINDOW,
    show_default=True,
    help="The most prompt tokens the draft model reads, the prompt's first 4 and its last "
    "ones (0: the whole prompt); outputs do not change.",
)
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--stats", is_flag=True, help="Print speed and acceptance statistics.")
@click.option("--json", "as_json", is_flag=True, help="Print text, ids and stats as JSON.")
@click.option(
    "--prediction-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text the output should mostly repeat (OpenAI's Predicted Outputs): a free draft.",
)
@click.option("--show-accepted", is_flag=True, help="Colour text the drafts or prediction made.")
@click.option("--json-schema", type=click.Path(path_type=Path), help="Output matches this schema.")
@click.option("--grammar", type=click.Path(path_type=Path), help="... this Lark or GBNF grammar.")
@click.option("--regex", help="... this regular expression.")
def generate(
    bundle,
    prompt,
    chat,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    min_p,
    seed,
    stop,
    controller,
    drafter,
    no_speculation,
    backend,
    threads,
    draft_window,
    stream,
    stats,
    as_json,
    prediction_file,
    show_accepted,
    json_schema,
    grammar,
    regex,
):
    """Generate from PROMPT with speculative decoding (constrained by a JSON schema, a grammar
    or a regular expression where given: exactly the constrained target's output)."""
    from specrt.runtime import SpeculativeRuntime

    runtime = SpeculativeRuntime.load(
        bundle,
        backend=backend,
        controller=controller,
        drafter=drafter,
        threads=threads,
        draft_window=draft_window or None,
        calibrate=False,
    )
    request = [{"role": "user", "content": prompt}] if chat else prompt
    runtime.calibrate(longest=len(runtime.encode(request)) + max_new_tokens)
    generation = runtime.stream(
        request,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        stop=stop,
        speculate=not no_speculation,
        prediction=prediction_file.read_text(encoding="utf-8") if prediction_file else None,
        structure=_structure(json_schema, grammar, regex),
    )
    for delta in generation:
        if stream and not as_json and not show_accepted:
            click.echo(delta, nl=False)
            sys.stdout.flush()
    _show(generation.result, runtime.tokenizer, stream, stats, as_json, show_accepted)


def _show(result, tokenizer, streamed: bool, stats: bool, as_json: bool, show_accepted: bool):
    """The result as the flags ask: JSON, the text coloured by origin, or the text (unless it
    was streamed already); the statistics after it."""
    from specrt.tools.display import LEGEND, accepted_text, format_stats, json_result

    if as_json:
        click.echo(json_result(result))
        return
    if show_accepted:
        click.echo(accepted_text(tokenizer, result))
        _log(LEGEND)
    else:
        click.echo("" if streamed else result.text)
    if stats:
        _log(format_stats(result.stats, result.finish_reason))
