"""Model sources: a Hugging Face folder, a hub id, or a GGUF file; their config and tokenizer.

This is where data enters specrt. The exporter reads a source's weights one tensor at a time
(exporter.tensors) to write a bundle; the torch reference engine loads the same source whole as
a transformers model (load_model) to run the baseline, so both see the very same weights.
torch and transformers are imported inside the functions: the lean runtime never imports this.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.files import sha256_file
from specrt.models import load_registry

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@dataclass(frozen=True)
class Source:
    """Where a model comes from; `spec` is what the user typed."""

    spec: str
    kind: str  # "folder" | "gguf" | "hub"

    @classmethod
    def parse(cls, spec: str) -> Source:
        """A folder, a .gguf file, a registry name (pulled with `specrt models pull`), or a hub
        id, in that order."""
        path = Path(spec).expanduser()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise SpecrtError(f"{spec}: folder has no config.json; is it a Hugging Face model?")
            return cls(str(path.resolve()), "folder")
        if path.suffix == ".gguf":
            if not path.is_file():
                raise SpecrtError(f"{spec}: GGUF file not found")
            return cls(str(path.resolve()), "gguf")
        if path.exists():
            raise SpecrtError(f"{spec}: not a model folder or a .gguf file")
        registry = load_registry()
        if spec in registry:
            if not registry[spec].is_pulled():
                raise SpecrtError(f"{spec} is not pulled yet: run `specrt models pull {spec}`")
            return cls(str(registry[spec].path()), "gguf")
        if spec.count("/") == 1 and not spec.startswith((".", "/")):
            return cls(spec, "hub")
        raise SpecrtError(f"{spec}: no such folder or file, and not a hub id (owner/name)")

    def weight_files(self) -> list[Path]:
        if self.kind == "gguf":
            return [Path(self.spec)]
        if self.kind == "folder":
            return sorted(p for p in Path(self.spec).iterdir() if p.suffix in WEIGHT_SUFFIXES)
        return []

    def sha256(self) -> str | None:
        """Digest over the weight files (None for a hub id: its revision is the identity)."""
        files = self.weight_files()
        if not files:
            return None
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode())
            digest.update(sha256_file(path).encode())
        return digest.hexdigest()

    def describe(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "sha256": self.sha256()}


def _pretrained_args(source: Source) -> tuple[str, dict]:
    if source.kind == "gguf":
        path = Path(source.spec)
        return str(path.parent), {"gguf_file": path.name}
    return source.spec, {}


def load_model(source: Source, dtype: str = "float32"):
    """The causal LM in eval mode; GGUF weights are dequantized by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    name, extra = _pretrained_args(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype), **extra)
    except (OSError, ValueError, ImportError) as err:
        raise SpecrtError(f"cannot load model from {source.spec}: {err}") from err
    return model.eval()


def load_config(source: Source):
    """The model's transformers config, from its config.json or its GGUF metadata (no weights)."""
    from transformers import AutoConfig

    name, extra = _pretrained_args(source)
    try:
        return AutoConfig.from_pretrained(name, **extra)
    except (OSError, ValueError, ImportError) as err:
        raise SpecrtError(f"cannot read the model config of {source.spec}: {err}") from err


def load_tokenizer(source: Source):
    """The transformers fast tokenizer (it can be saved as tokenizer.json for the lean runtime)."""
    from transformers import AutoTokenizer

    name, extra = _pretrained_args(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **extra)
    except (OSError, ValueError, ImportError) as err:
        raise SpecrtError(f"cannot load tokenizer from {source.spec}: {err}") from err
    if not tokenizer.is_fast:
        raise SpecrtError(f"{source.spec}: only fast (tokenizer.json) tokenizers are supported")
    return tokenizer
