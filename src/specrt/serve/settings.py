"""One settings object for the server, filled by the CLI (and its environment variables) or by
a program that hosts the app itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.runtime.controller import make_controller


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
        if self.max_queue < 1:
            raise SpecrtError(
                f"--max-queue must be >= 1 (requests wait there), got {self.max_queue}"
            )
