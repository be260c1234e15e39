"""What one request's stream carries from the engines to the app: text as it comes, then the
result or the error that ended it. The same events cross a process under Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

from specrt.runtime import Result, TokenLogprob
from specrt.serve.errors import APIError


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # where the request asked


@dataclass
class Done:
    result: Result


@dataclass
class Failed:
    error: APIError


Event = Delta | Done | Failed


def is_last(event: Event) -> bool:
    return not isinstance(event, Delta)
