"""File helpers shared by every stage: content hashes and writes that are never seen half done."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from specrt.errors import SpecrtError


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def hash_tree(folder: Path) -> dict[str, str]:
    """sha256 of every file below folder, keyed by its path relative to folder."""
    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _umask_mode(mode: int) -> int:
    """mkstemp/mkdtemp create private files; published files get the usual umask mode instead."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_json_atomic(path: Path, data: dict) -> None:
    write_bytes_atomic(path, json.dumps(data, indent=2, sort_keys=True).encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file beside path, fsync, then rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _umask_mode(0o666))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(out: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside `out`; on success it replaces `out`, on failure it vanishes.

    A process killed outright (SIGKILL, power loss) cannot clean up, so its temp folder names
    its process id, and the next build of the same `out` removes folders whose process is gone.
    """
    out = out.resolve()
    if out.exists() and not force:
        raise SpecrtError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.building-{os.getpid()}-"))
    os.chmod(tmp, _umask_mode(0o777))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale(out: Path) -> list[Path]:
    """Remove the temp folders that builds of `out` left when killed; return them."""
    removed = []
    for leftover in out.parent.glob(f".{out.name}.building-*"):
        pid = leftover.name.removeprefix(f".{out.name}.building-").split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def specrt_home() -> Path:
    """Where pulled models and cached bundles live: $SPECRT_HOME, else the user cache folder."""
    if "SPECRT_HOME" in os.environ:
        return Path(os.environ["SPECRT_HOME"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "specrt"


# a program by a path of the machine's: llama.cpp's from its build folder, specrt's from a venv
PROGRAM = re.compile(r"[\w.~+$/-]*/(llama-(?:server|bench|cli)|(?<=/bin/)specrt)\b")


def portable(value):
    """A result (a dict, a list, a string) with its paths and commands as a user would type
    them on any machine: specrt's home as $SPECRT_HOME, llama.cpp's programs and specrt by
    name (on the PATH, as docs/benchmarks.md builds them), the user's home as ~. Which
    machine ran it is `machine.describe()`'s, in a field of its own."""
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [portable(item) for item in value]
    if not isinstance(value, str):
        return value
    value = value.replace(str(specrt_home()), "$SPECRT_HOME")
    value = PROGRAM.sub(r"\1", value)
    return value.replace(str(Path.home()), "~")


def write_result(out: Path | None, result: dict, text: str) -> None:
    """A benchmark's result as OUT.json (the record) and OUT.md (what people read), atomically;
    nothing where out is None (the figures were only printed). Paths and commands are
    written `portable`."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)  # a long run must not be lost to a missing folder
    write_json_atomic(out.with_suffix(".json"), portable(result))
    write_bytes_atomic(out.with_suffix(".md"), portable(text).encode())
