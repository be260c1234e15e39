"""The documentation's results tables are rendered from benchmarks/results/*.json, each under a
line naming its CPU and date; a file that names no machine, or of a kind nothing renders, is
refused rather than shown. (CI also builds the site with `mkdocs build --strict`.)"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^ *<!-- results: ([\w.\-]+) -->$", re.M)  # indented: in a list item


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render_results():
    return _load("render_results", ROOT / "benchmarks" / "render_results.py")


def _markers() -> list[str]:
    return sorted(
        {m for page in (ROOT / "docs").glob("*.md") for m in MARKER.findall(page.read_text())}
    )


def test_every_results_table_in_the_docs_renders_and_names_its_cpu_and_date(render_results):
    names = _markers()
    assert names, "the docs show no results"
    for name in names:
        result = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
        text = render_results.render(name)
        head = text.splitlines()[0]
        assert head.startswith(f"**Measured on {result['machine']['cpu']} (")
        assert result["machine"]["date"] in head and "|---" in text
    index = render_results.index()
    assert all(f"`{name}`" in index for name in names)


def test_a_marker_under_a_list_item_renders_in_the_item():
    """A marker indented under a list item is replaced by its tables at that indent (before,
    only a marker at the margin was, and limits.md's stayed HTML comments on the site)."""
    hook = _load("results_hook", ROOT / "docs" / "hooks" / "results.py")
    name = _markers()[0]
    page = f"- a finding\n\n  <!-- results: {name} -->\n\nAfter.\n"
    out = hook.on_page_markdown(page, None, None, None)
    assert "<!-- results" not in out
    table = out.split("\n\n", 1)[1].rsplit("\n\nAfter.", 1)[0]
    assert "|---" in table and all(line.startswith("  ") for line in table.splitlines() if line)
    assert "#" not in table.split("|", 1)[0]  # its headings are bold lines there
    margin = hook.on_page_markdown(f"<!-- results: {name} -->\n", None, None, None)
    assert margin.startswith("**Measured on ")


def test_a_result_without_its_machine_or_renderer_is_refused(render_results, tmp_path, monkeypatch):
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    machine = {"cpu": "AMD EPYC", "simd": ["AVX2"], "cores": 2, "date": "2026-11-25"}
    (tmp_path / "bare.json").write_text(json.dumps({"kind": "bench", "configs": []}))
    (tmp_path / "odd.json").write_text(json.dumps({"kind": "poetry", "machine": machine}))
    with pytest.raises(render_results.RenderError, match="records no machine"):
        render_results.render("bare")
    with pytest.raises(render_results.RenderError, match="no renderer"):
        render_results.render("odd")
    with pytest.raises(render_results.RenderError, match="no results file"):
        render_results.render("missing")
    assert render_results.renderable() == []


def test_results_record_commands_as_a_user_types_them(tmp_path, monkeypatch):
    """Paths and commands are written `portable` (write_result, write_report): specrt's home
    as $SPECRT_HOME, llama.cpp's programs by name, the home folder as ~; and no committed
    result names a folder of the machine that ran it (its machine has a field of its own)."""
    from specrt.files import portable, write_result

    monkeypatch.setenv("HOME", "/home/ci")
    monkeypatch.setenv("SPECRT_HOME", "/home/ci/.cache/specrt")
    ran = "/opt/llama.cpp/build/bin/llama-server -m /home/ci/.cache/specrt/models/t.gguf -np 4"
    result = {"command": ran, "rows": [{"bundle": "/home/ci/bundles/b"}], "tokens": 3}
    write_result(tmp_path / "r", result, f"`{ran}`")
    assert json.loads((tmp_path / "r.json").read_text()) == {
        "command": "llama-server -m $SPECRT_HOME/models/t.gguf -np 4",
        "rows": [{"bundle": "~/bundles/b"}],
        "tokens": 3,
    }
    assert (tmp_path / "r.md").read_text() == "`llama-server -m $SPECRT_HOME/models/t.gguf -np 4`"
    assert portable("/usr/bin/python benchmarks/x.py") == "/usr/bin/python benchmarks/x.py"
    assert portable("/work/main/.venv/bin/specrt build") == "specrt build"
    machine_paths = re.compile(r"(?<![\w$~.])/(root|home|tmp|Users|work)/")
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.*")):
        if path.suffix in (".json", ".md"):
            assert not machine_paths.search(path.read_text()), path.name
