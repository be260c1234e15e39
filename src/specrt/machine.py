"""Which machine a figure came from: the CPU, its SIMD features, and the library versions.

Speeds, the best K and even a kernel's numbers differ between CPUs of one family (ONNX Runtime
picks its MatMulNBits kernels by AVX2, AVX-512, VNNI and AMX), so every benchmark result and
`specrt doctor` names them. Reads /proc/cpuinfo where there is one; elsewhere the CPU is what
`platform` says and the feature list is empty (unknown, not absent).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from pathlib import Path

# cpuinfo flag -> the name people use, in the order they are shown. x86 first, then Arm.
SIMD_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX512-VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512_bf16": "AVX512-BF16",
    "amx_tile": "AMX",
    "asimd": "NEON",
    "asimddp": "DOTPROD",
    "i8mm": "I8MM",
    "sve": "SVE",
}
VERSIONED = ("onnxruntime", "onnxruntime-gpu", "numpy", "torch", "transformers")


def cpu_facts(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """(CPU model name, its SIMD features by SIMD_FLAGS' names) from /proc/cpuinfo's text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features"):
            flags.update(value.split())
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return model, [name for flag, name in SIMD_FLAGS.items() if flag in flags]


def versions(names: tuple[str, ...] = VERSIONED) -> dict[str, str]:
    """Installed versions of these distributions (by default, the libraries whose kernels or
    numbers a result depends on); those not installed are left out."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def describe(threads: int | None = None) -> dict:
    """This machine, as results record it."""
    cpu, simd = cpu_facts()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "simd": simd,
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1),
        "threads": threads,
        "python": platform.python_version(),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
    }


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes the system can give without swapping (Linux's MemAvailable), None where unknown."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def label(machine: dict) -> str:
    """One line naming a recorded machine: 'AMD EPYC (AVX2, AVX-512, AVX512-VNNI), 2 cores,
    onnxruntime 1.32.0'. Results written before the SIMD features were recorded say so."""
    simd = machine.get("simd")
    features = "SIMD features not recorded" if simd is None else ", ".join(simd) or "no AVX2"
    ort = machine.get("versions", {}).get("onnxruntime")
    runtime = f", onnxruntime {ort}" if ort else ""
    return f"{machine['cpu']} ({features}), {machine['cores']} cores{runtime}"
