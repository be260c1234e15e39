"""One settings object for the server, filled by the CLI (and its environment variables) or by
a program that hosts the app itself; and, for Ray Serve, how its engine deployment scales."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.runtime.budget import parse_bytes, parse_size
from specrt.runtime.controller import make_controller
from specrt.runtime.drafters import DRAFT_WINDOW, SINKS
from specrt.runtime.prefix_store import default_capacity
from specrt.runtime.scheduler import PREFILL_CHUNK
from specrt.runtime.text import read_template
from specrt.serve.reasoning import PARSERS
from specrt.serve.tool_formats import PARSERS as TOOL_PARSERS


@dataclass(frozen=True)
class ServeSettings:
    bundle: Path
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    max_batch: int = 8  # requests advanced together (engine slots); more wait in the queue
    max_queue: int = 32  # requests waiting for a slot; past this, 429
    timeout: float | None = 600.0  # seconds a request may take in all, queue included
    controller: str = "adaptive"  # the default `speculation` of a request
    drafter: str | None = None  # model | ngram | hybrid; default: the runtime's
    api_key: str | None = None  # when set, every route but /health needs it
    model_name: str | None = None  # the `model` clients send; default: the bundle folder's name
    backend: str = "onnxruntime"
    threads: int | None = None
    calibrate: bool = True  # measure the cost curves before reporting ready
    prompt_cache: bool = True  # a prompt starts from what a slot already holds of it
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens fed between rounds (0: each whole)
    draft_window: int = DRAFT_WINDOW  # prompt tokens the draft model reads (0: all)
    kv_budget: str | None = None  # cache positions ("65536") or bytes ("12GB") slots share
    prefix_cache: str | None = None  # host memory for prefixes beyond the slots ("0": none)
    chat_template: Path | None = None  # a Jinja file used in place of the bundle's template
    reasoning_parser: str = "auto"  # thoughts apart from answers: auto, think or none
    tool_parser: str = "auto"  # the tool calls' format (tool_formats.PARSERS)
    max_body_size: str = "16MB"  # a larger request body is refused (413) before it is read
    drain_timeout: float = 25.0  # seconds from SIGTERM to exit (under Kubernetes' 30 s grace)

    @property
    def served_model(self) -> str:
        return self.model_name or Path(self.bundle).resolve().name

    def check(self) -> None:
        """Refuse what would only fail after start-up: a missing or damaged bundle, a bad
        default speculation or drafter for it, no slots or no queue."""
        bundle = Bundle.load(self.bundle)
        if self.controller != "off":
            make_controller(self.controller, bundle.max_draft)
        if self.drafter in ("model", "hybrid") and not bundle.has_draft:
            raise SpecrtError(
                f"--drafter {self.drafter} needs a draft model; {self.bundle} has none"
            )
        if self.max_batch < 1:
            raise SpecrtError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk < 0:
            raise SpecrtError(
                f"--prefill-chunk must be >= 0 (0: each prompt whole), got {self.prefill_chunk}"
            )
        if self.draft_window and self.draft_window <= SINKS:
            raise SpecrtError(
                f"--draft-window must be 0 (the whole prompt) or more than {SINKS}, got "
                f"{self.draft_window}"
            )
        if self.max_queue < 1:
            raise SpecrtError(
                f"--max-queue must be >= 1 (requests wait there), got {self.max_queue}"
            )
        if self.kv_budget is not None:
            parse_size(self.kv_budget)
        self.prefix_bytes()
        if self.body_bytes() < 1:
            raise SpecrtError(f"--max-body-size must be more than 0, got {self.max_body_size!r}")
        if self.drain_timeout < 0:
            raise SpecrtError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        self.template()
        if self.tool_parser not in TOOL_PARSERS:
            raise SpecrtError(
                f"--tool-parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}"
            )
        if self.reasoning_parser not in PARSERS:
            raise SpecrtError(
                f"--reasoning-parser must be one of {', '.join(PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )

    def template(self) -> str | None:
        """--chat-template's text, checked (None: the bundle's own)."""
        return read_template(self.chat_template) if self.chat_template else None

    def body_bytes(self) -> int:
        return parse_bytes(self.max_body_size, "--max-body-size")

    def prefix_bytes(self) -> int:
        """Bytes of host memory the prefix store may take: --prefix-cache, or the default
        (prefix_store.default_capacity); none without the prompt cache."""
        if not self.prompt_cache:
            return 0
        if self.prefix_cache is None:
            return default_capacity()
        return parse_bytes(self.prefix_cache, "--prefix-cache")


@dataclass(frozen=True)
class RayOptions:
    """How the engine deployment scales. Autoscaling is on when either bound is given."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # per replica; default: its batch slots
    cpus_per_replica: float | None = None  # what Ray reserves; default: --threads, else 1
    ingress_replicas: int = 1
    graceful_shutdown_s: float = 120.0  # a replica leaving finishes its requests this long
    health_check_period_s: float = 10.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas when autoscaling: min defaults to 1, max to max(min, 1)."""
        low = 1 if self.min_replicas is None else self.min_replicas
        return low, self.max_replicas if self.max_replicas is not None else max(low, 1)

    def check(self) -> None:
        if self.replicas < 1 or self.ingress_replicas < 1:
            raise SpecrtError("--replicas must be >= 1")
        low, high = self.bounds
        if self.autoscaling and not (low >= 0 and high >= max(low, 1)):
            raise SpecrtError(
                f"--min-replicas {low} and --max-replicas {high}: need 0 <= min <= max, max >= 1"
            )
