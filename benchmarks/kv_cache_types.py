"""What a float16 cache costs or buys per decode step against float32, as the context grows.

Two bundles of the same pair, one built with `--kv-cache float16`. Each target's slot is filled to
N positions with random keys and values, written straight into its cache (a step's cost depends
on how many positions it reads, not on what they hold), then one-token decode steps are timed,
the two bundles interleaved so a slow moment costs both alike; the median of RUNS per length.
The step is what the target alone pays for each token; a float32 cache is read in place by a
lone row's attention, a float16 one is cast to float32 as it is read (exporter/attention.py).

    python benchmarks/kv_cache_types.py FLOAT32_BUNDLE FLOAT16_BUNDLE \
        [--sizes 512,2048,4096,8192,16000] [--out benchmarks/results/cpu-kv-cache-types]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import numpy as np

from specrt import machine
from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.files import write_result

RUNS = 20  # decode steps timed per bundle and length
FILL = 1024  # positions written at once while filling a slot


def fill(engine, positions: int, rng) -> None:
    """Empty slot 0, then write `positions` random keys and values into it."""
    engine.reset(0)
    shape = engine.read_positions(0, 0, 0)  # [caches, 0, kv_heads, head_dim], the cache's type
    for start in range(0, positions, FILL):
        n = min(FILL, positions - start)
        data = rng.standard_normal((shape.shape[0], n, *shape.shape[2:]), np.float32) * 0.5
        engine.write_positions(0, [7] * n, data.astype(shape.dtype))


def measure(paths: dict[str, Path], sizes: list[int]) -> dict:
    engines = {kind: load_engine(Bundle.load(path), "target", even_rows=False)
               for kind, path in paths.items()}  # fmt: skip
    rng = np.random.default_rng(0)
    steps: dict[str, dict[str, float]] = {kind: {} for kind in engines}
    for n in sizes:
        for engine in engines.values():
            fill(engine, n, rng)
            engine.forward([11])  # warm
            engine.rollback(n)
        times: dict[str, list[float]] = {kind: [] for kind in engines}
        for _ in range(RUNS):
            for kind, engine in engines.items():
                start = time.perf_counter()
                engine.forward([11])
                times[kind].append(time.perf_counter() - start)
                engine.rollback(n)
        for kind in engines:
            steps[kind][str(n)] = round(1000 * statistics.median(times[kind]), 1)
    positions = {kind: e.position_bytes for kind, e in engines.items()}
    return {"decode_ms": steps, "position_bytes": positions}


def markdown(result: dict) -> str:
    sizes, steps = result["sizes"], result["decode_ms"]
    lines = [
        "# A float16 cache against float32: the target's decode step",
        "",
        f"The default pair's target, its slot filled to N positions, one-token decode steps, "
        f"the median of {RUNS} per length, the two bundles interleaved. `{result['command']}`",
        "",
        "| cache | bytes a position | " + " | ".join(f"at {n:,}" for n in sizes) + " |",
        "|---" * (len(sizes) + 2) + "|",
    ]
    for kind, row in steps.items():
        cells = [f"{row[str(n)]:.1f} ms" for n in sizes]
        size = f"{result['position_bytes'][kind] / 1024:.0f} KB"
        lines.append(f"| {kind} | {size} | " + " | ".join(cells) + " |")
    ratio = [f"{steps['float32'][str(n)] / steps['float16'][str(n)]:.2f}×" for n in sizes]
    lines.append("| float16's speed over float32's | | " + " | ".join(ratio) + " |")
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("float32", type=click.Path(exists=True, path_type=Path))
@click.argument("float16", type=click.Path(exists=True, path_type=Path))
@click.option("--sizes", default="512,2048,4096,8192,16000", show_default=True)
@click.option("--out", type=Path, default=Path("benchmarks/results/cpu-kv-cache-types"))
def main(float32: Path, float16: Path, sizes: str, out: Path) -> None:
    lengths = [int(n) for n in sizes.split(",")]
    result = {
        "kind": "kv_cache_types",
        "machine": machine.describe(),
        "command": f"python benchmarks/kv_cache_types.py FLOAT32_BUNDLE FLOAT16_BUNDLE "
        f"--sizes {sizes}",
        "sizes": lengths,
        **measure({"float32": float32, "float16": float16}, lengths),
    }
    write_result(out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
