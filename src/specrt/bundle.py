"""The engine bundle: the contract between the exporter (which writes it) and the engines.

A bundle is a folder holding manifest.json and one subfolder per role (draft/, target/) with the
graph files and the tokenizer. The manifest records every file's sha256; loading refuses, with a
message naming the problem, anything missing, altered, of an unknown format, or a draft/target
pair whose vocabularies differ. Bundles are written into a temporary sibling folder and renamed
into place, so an interrupted build never leaves half a bundle.

Hashing gigabytes at every load would dominate start-up, so a successful full check leaves a
stamp (each file's size and mtime, keyed by the manifest's own hash), as git's index does; later
loads re-hash only files whose stamp changed. `inspect` always re-hashes everything.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import BundleError
from specrt.files import sha256_file, write_json_atomic

# 2: caches laid out [batch, positions, kv_heads, head_dim] (exporter/attention.py); a bundle
# of version 1 ([batch, kv_heads, positions, head_dim]) is refused with "rebuild the bundle".
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
STAMP = ".verified.json"
ROLES = ("draft", "target")
QUANTIZED = ("int8", "int4", "gguf")  # weights in MatMulNBits blocks
# Cache positions past the max context, for the padding tokens of a batched call: a row near the
# end of its context still gets padded to the call's width (see exporter/graph.py).
CACHE_MARGIN = 64
# The rows of a batched call whose caches the CPU graph reads where they lie: each has an
# optional input per cache, `row_view(cache, row)`, that the engine binds to the row's own
# positions (exporter/attention.py). A wider batch, or one bound without them, is copied row by row.
VIEW_ROWS = 16


def row_view(cache: str, row: int) -> str:
    """The optional input through which a batched call reads one row's cache where it lies:
    past_key_values.N.kind -> row_view.R.N.kind (outside the past_key_values names, which
    tools take for the cache itself)."""
    return cache.replace("past_key_values", f"row_view.{row}", 1)


@dataclass(frozen=True)
class Role:
    """One model of the pair as the engines see it."""

    name: str
    folder: Path
    info: dict

    @property
    def graph(self) -> Path:
        return self.folder / self.info["graph"]

    def graph_for(self, backend: str) -> Path:
        """The graph this backend runs: the role's GPU graph (batched attention, caches by
        head) where the bundle has one for it, else the graph every backend runs."""
        gpu = self.info.get("gpu", {})
        if backend in gpu.get("backends", ()):
            return self.folder / gpu["graph"]
        return self.graph

    @property
    def tokenizer_file(self) -> Path:
        return self.folder / "tokenizer.json"

    def dim(self, key: str) -> int:
        return int(self.info["shape"][key])

    @property
    def precision(self) -> str:
        """fp32, fp16, int8, int4 or gguf (bundles from before per-role precision are fp32)."""
        return self.info.get("precision", {}).get("weights", "fp32")

    @property
    def kv_cache(self) -> str:
        """What the graph keeps keys and values in: float32, or float16 (an fp16 graph, or
        a half-size cache asked for at build)."""
        if self.precision == "fp16":
            return "float16"
        return self.info.get("precision", {}).get("cache", "float32")


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: dict

    @property
    def max_context(self) -> int:
        return int(self.manifest["max_context"])

    @property
    def max_draft(self) -> int:
        return int(self.manifest["max_draft"])

    @property
    def max_lookup(self) -> int:
        """The longest window of free drafts (a lookup, a prediction) one verify call takes;
        bundles built before long windows: K_max (their verify shapes end there)."""
        return int(self.manifest.get("max_lookup", self.max_draft))

    @property
    def cache_margin(self) -> int:
        """Cache positions past max_context that the graphs' rotary tables cover."""
        return int(self.manifest.get("kv_cache", {}).get("margin", 0))

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest["eos_token_ids"])

    def role(self, name: str) -> Role:
        return Role(name, self.path / name, self.manifest["roles"][name])

    @property
    def has_draft(self) -> bool:
        """False for a target-only bundle, which speculates by lookup (n-gram) alone."""
        return "draft" in self.manifest["roles"]

    @property
    def roles(self) -> list[str]:
        return [r for r in ROLES if r in self.manifest["roles"]]

    @property
    def precision_label(self) -> str:
        """e.g. d-int4_t-fp32 (or t-fp32 without a draft): what each role runs at, as bench
        rows are named."""
        target = f"t-{self.role('target').precision}"
        return f"d-{self.role('draft').precision}_{target}" if self.has_draft else target

    @classmethod
    def load(cls, path: str | Path, *, full_check: bool = False) -> Bundle:
        """Validate and open a bundle; full_check re-hashes every file, ignoring the stamp."""
        folder = Path(path)
        manifest = read_manifest(folder)
        check_pair(manifest)
        check_files(folder, manifest, full=full_check)
        return cls(folder, manifest)


def read_manifest(folder: Path) -> dict:
    file = folder / MANIFEST
    if not folder.is_dir():
        raise BundleError(f"{folder}: no such bundle folder")
    if not file.is_file():
        raise BundleError(f"{folder}: not a bundle (no {MANIFEST}); build one with `specrt build`")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{file}: manifest is not valid JSON ({err})") from err
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{file}: bundle format version {version!r} is not supported by this specrt "
            f"(it reads version {FORMAT_VERSION}); rebuild the bundle or upgrade specrt"
        )
    if "target" not in manifest.get("roles", {}):
        raise BundleError(f"{file}: manifest has no entry for the target")
    return manifest


def check_pair(manifest: dict) -> None:
    """The draft must speak the target's vocabulary, or its proposals mean other words."""
    if "draft" not in manifest["roles"]:
        return
    draft, target = manifest["roles"]["draft"], manifest["roles"]["target"]
    dv, tv = draft["shape"]["vocab_size"], target["shape"]["vocab_size"]
    ids = target.get("tokenizer_ids", tv)  # bundles before padded pairs: logits must match
    if dv != tv and min(dv, tv) < ids:
        raise BundleError(
            f"draft and target vocabularies differ: draft has {dv} logits, target has {tv}, "
            f"and their tokenizer has {ids} ids; logits may be padded past the tokenizer's ids, "
            "not fall short of them"
        )
    if draft["tokenizer_sha256"] != target["tokenizer_sha256"]:
        raise BundleError(
            "draft and target tokenizers differ (their tokenizer.json vocabularies "
            "do not match); speculation needs one shared tokenizer"
        )


def check_files(folder: Path, manifest: dict, *, full: bool) -> None:
    manifest_hash = sha256_file(folder / MANIFEST)
    stamp = {} if full else _read_stamp(folder, manifest_hash)
    seen = {}
    for role in manifest["roles"]:
        for rel, expected in manifest["roles"][role]["files"].items():
            path = folder / role / rel
            name = f"{role}/{rel}"
            if not path.is_file():
                raise BundleError(f"{folder}: file {name} is missing")
            stat = path.stat()
            key = [stat.st_size, stat.st_mtime_ns]
            if stamp.get(name) != key and sha256_file(path) != expected:
                raise BundleError(
                    f"{folder}: file {name} does not match its recorded sha256 "
                    "(corrupted or modified); rebuild the bundle"
                )
            seen[name] = key
    with contextlib.suppress(OSError):  # a read-only bundle still loads, just hashes again
        write_json_atomic(folder / STAMP, {"manifest_sha256": manifest_hash, "files": seen})


def _read_stamp(folder: Path, manifest_hash: str) -> dict:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return stamp.get("files", {}) if stamp.get("manifest_sha256") == manifest_hash else {}
