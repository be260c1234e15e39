"""One generation per call, timed token by token, for each engine `specrt bench` compares:
transformers (alone and assisted), ONNX Runtime GenAI, specrt, llama-server. Each runner takes
the prompt's token ids and returns a `Run`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.runtime import SpeculativeRuntime
from specrt.tools import llamacpp


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    ttft: float
    token_times: list[float]
    target_calls: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    prediction: tuple[int, int] | None = None  # prediction tokens accepted, rejected


class _TimingStreamer:
    """transformers streamer that timestamps every generated token (the first put is the
    prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times += [time.perf_counter() - self.start] * int(value.numel())

    def end(self) -> None:
        pass


def hf_runner(
    model, max_new_tokens: int, assistant=None, eos: list[int] | None = None
) -> Callable[[list[int]], Run]:
    """transformers generate, greedy; EOS ignored (as specrt's ignore_eos) for equal lengths
    unless eos lists the ids to stop at."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )

    def run(ids: list[int], _index: int | None = None) -> Run:
        streamer = _TimingStreamer()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                generation_config=config,
                assistant_model=assistant,
                streamer=streamer,
            )
        seconds = time.perf_counter() - streamer.start
        tokens = out[0, len(ids) :].tolist()
        return Run(
            tokens,
            seconds,
            streamer.times[0],
            streamer.times,
            target_calls=len(tokens) if assistant is None else None,
        )

    return run


def genai_runner(
    folder: Path, max_new_tokens: int, stop_at_eos: bool = False
) -> Callable[[list[int]], Run]:
    """ONNX Runtime GenAI's own loop (target alone, greedy). min_length pins the length, as
    ignore_eos does for the others (it differs only after an EOS, which the comparison shows),
    unless stop_at_eos."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def run(ids: list[int], _index: int | None = None) -> Run:
        params = og.GeneratorParams(model)
        total = len(ids) + max_new_tokens
        shortest = len(ids) + 1 if stop_at_eos else total
        params.set_search_options(max_length=total, min_length=shortest, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        tokens, times = [], []
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            times.append(time.perf_counter() - start)
        return Run(tokens, times[-1], times[0], times, target_calls=len(tokens))

    return run


def specrt_runner(
    rt: SpeculativeRuntime,
    max_new_tokens: int,
    stop_at_eos=False,
    guesses: Sequence[str | None] = (),
    **options,
):
    """guesses: the prediction sent with each prompt (by its index), for prediction rows."""

    def run(ids: list[int], index: int | None = None) -> Run:
        guess = guesses[index] if guesses and index is not None else None
        result = rt.generate(
            ids,
            max_new_tokens=max_new_tokens,
            ignore_eos=not stop_at_eos,
            prediction=guess,
            **options,
        )
        s = result.stats
        return Run(
            result.token_ids,
            s.total_seconds,
            s.ttft_seconds,
            s.token_times,
            s.target_calls,
            s.drafted,
            s.accepted,
            (s.accepted_prediction_tokens, s.rejected_prediction_tokens) if guess else None,
        )

    return run


def llamacpp_runner(base: str, max_new_tokens: int, stop_at_eos: bool = False):
    """llama-server's greedy completion of the same token ids (EOS ignored unless
    stop_at_eos); its token times are when each streamed chunk arrived."""

    def run(ids: list[int], _index: int | None = None) -> Run:
        tokens, times = llamacpp.complete(base, ids, max_new_tokens, not stop_at_eos)
        return Run(tokens, times[-1], times[0], times)

    return run
