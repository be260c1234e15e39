"""ONNX Runtime engine: the bundle's graph with its KV cache preallocated and updated in place.

Each layer's key/value buffer is one OrtValue of [slots, capacity, kv_heads, head_dim], bound
through IOBinding as both the `past` input and the `present` output, so the graph scatters new
entries into it and no step copies the cache. A call of one row binds its slot at exactly the
call's length, so the graph's attention reads the cache in place (exporter/attention.py); a call
of several binds their slots whole, and each row's view of them at its own length, which the
graph's attention reads in place too. The current length lives in Python: rollback is setting an
int, and the next call's attention_mask length tells the graph where to write. Logits land in a
preallocated host buffer. Cache and logits take the graph's own float type (an fp16 graph keeps
an fp16 cache); the runtime always receives float32 logits. A GPU graph's caches are laid out
by head, [slots, kv_heads, capacity, head_dim], and bound whole in every call (exporter/
batched_attention.py); on onnxruntime-cuda its decode and verify calls replay CUDA graphs
(cuda_graphs.py). Imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import mmap
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.bundle import VIEW_ROWS, Bundle, row_view
from specrt.engines.base import BufferCache, RowCall, check_rollback, check_room, check_slot
from specrt.engines.cuda_graphs import CudaGraphs, widest_for
from specrt.engines.ort_providers import (
    DEVICE_OF_PROVIDER,
    check_providers,
    provider_name,
    providers_for,
)
from specrt.engines.rows import RowProbe, cut_difference
from specrt.errors import SpecrtError

FLOAT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
# The most tokens of one row a call carries; a longer row goes in pieces. Measured on the
# default pair, a 6,039-token prompt alone: fed whole, 126.9 s to the first token and a peak
# RSS of 7.0 GB; in pieces of 512 tokens, 87.6 s and 3.2 GB; of 256, 86.7 s and 2.9 GB
# (docs/limits.md, "Long prompts").
PIECE = 256
_FIRST_CACHE = "past_key_values.0.key"


def default_threads() -> int:
    """Decoding streams weights: one thread per core saturates memory bandwidth on small boxes."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


class OrtEngine(BufferCache):
    def __init__(
        self,
        graph: Path,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        capacity: int,
        margin: int = 0,
        slots: int = 1,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        threads: int | None = None,
        even_rows: bool = False,
        cuda_graphs: int = 0,
    ):
        """margin: cache positions past capacity that the graph covers, for padding (a graph
        without one holds one slot); even_rows: run every call on an even number of rows (see
        `_call`; `probe_rows` decides it); cuda_graphs: the widest call replayed from a CUDA
        graph (cuda_graphs.py; a graph by head only, its CUDA provider started with
        `enable_cuda_graph`), 0 for none."""
        if slots > 1 and not margin:
            raise SpecrtError(
                f"{graph}: no cache margin for the padding of a batched call (the bundle's "
                "kv_cache.margin is 0); rebuild the bundle with this specrt to serve batches"
            )
        providers = list(providers or ["CPUExecutionProvider"])
        self.session = _session(graph, providers, threads)
        self.device = DEVICE_OF_PROVIDER.get(provider_name(providers[0]), "cpu")
        self.graph = graph
        self.vocab_size, self.slots = vocab_size, slots
        self._capacity, self._margin = capacity, margin
        self.pad_to_even_rows(even_rows)
        self.row_probe: RowProbe | None = None  # what `probe_rows` found, if it ran
        self._positions_held = capacity + margin
        self._start_cache(slots)
        self._binding = self.session.io_binding()
        values = [*self.session.get_inputs(), *self.session.get_outputs()]
        args = {value.name: value for value in values}
        self._cache_type = FLOAT_TYPES[args[_FIRST_CACHE].type]
        self._logits_type = FLOAT_TYPES[args["logits"].type]
        self._layout(args[_FIRST_CACHE].shape, providers, num_kv_heads, head_dim, cuda_graphs)
        # A batch of up to this many rows reads each row's cache where it lies, through row
        # views (exporter/attention.py); 0 for a graph without them (built before them).
        # Inputs with a default are ONNX Runtime's "overridable initializers".
        views = {value.name for value in self.session.get_overridable_initializers()}
        self._views = self._in_place and row_view(_FIRST_CACHE, 0) in views
        self._view_rows = VIEW_ROWS if self._views else 0
        self._pages: list[mmap.mmap] = []  # the CPU caches' mappings (see `release`)
        self._caches = [
            self._zeros([slots, *self._row_shape], f"past_key_values.{i}.{kind}")
            for i in range(num_layers)
            for kind in ("key", "value")
        ]
        self._row_bytes = int(np.prod(self._row_shape)) * np.dtype(self._cache_type).itemsize
        self._bound = (0, 0, 0)  # (first slot, rows, positions) the caches are bound for
        self._mask = np.ones((slots, self._positions_held), np.int64)
        self._logits = np.empty(slots * 16 * vocab_size, self._logits_type)  # grows as needed

    def _layout(self, dims: list, providers: list, kv: int, head_dim: int, graphs: int) -> None:
        """How the caches are laid out and bound, from the graph's cache dims. A graph whose
        caches are laid out by head attends over them whole in every call (exporter/
        batched_attention.py) and may replay CUDA graphs; the CPU graph's lone row binds at its
        length, but TensorRT's profiles fix the caches' shape."""
        self.by_head = dims[2] == "positions"
        trt = provider_name(providers[0]) == "TensorrtExecutionProvider"
        self._in_place = not (trt or self.by_head)
        held = self._positions_held
        self._row_shape = [kv, held, head_dim] if self.by_head else [held, kv, head_dim]
        if graphs and not self.by_head:
            raise SpecrtError(
                f"{self.graph}: CUDA graphs need a graph without control flow (the GPU graph "
                "of `specrt build --backend onnxruntime-cuda`)"
            )
        self._graphs = CudaGraphs(self.session, self.device, graphs) if graphs else None

    def read_rows_in_place(self, on: bool) -> None:
        """Let a batch's rows read their caches through their views (the default where the
        graph has them), or copy each row out in the graph's Loop (a benchmark's baseline).
        Off starts a fresh binding: a view left bound would still be read."""
        self._view_rows = VIEW_ROWS if on and self._views else 0
        if not on:
            self._binding, self._bound = self.session.io_binding(), (0, 0, 0)

    def pad_to_even_rows(self, on: bool) -> None:
        """Run every later call on an even number of rows (see `_call`), or not."""
        self.even_rows = on
        # Without a margin, a padding token needs a position inside the capacity.
        self.capacity = self._capacity - 1 if on and not self._margin else self._capacity

    def probe_rows(self) -> RowProbe:
        """Pad calls to even rows only where this machine's kernels need it (see rows.py):
        compare odd calls with even ones bit for bit, unpadded, and where they differ, padded."""
        self.pad_to_even_rows(False)
        unpadded = cut_difference(self)
        padded = None
        if unpadded != 0.0:
            self.pad_to_even_rows(True)
            padded = cut_difference(self)
        self.row_probe = RowProbe(unpadded, padded)
        if not self.row_probe.exact:
            warnings.warn(f"{self.graph}: {self.row_probe.describe()}", stacklevel=2)
        return self.row_probe

    def _zeros(self, shape: list[int], name: str) -> tuple[str, ort.OrtValue, np.ndarray | None]:
        """A zeroed cache buffer in an anonymous mapping of its own: the system commits a page
        only when it is first written, so positions no sequence reached cost no memory, and
        `release` hands a slot's pages back (they read as zeros again). Zeros matter: rows
        shorter than a batched call's longest read keys past their own length (masked out,
        weight 0), and 0 times uninitialised memory that happens to hold a NaN is still NaN. A
        CPU OrtValue uses the array's memory, so it is kept; a device copy does not need it."""
        size = int(np.prod(shape)) * np.dtype(self._cache_type).itemsize
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        # Private: a shared anonymous mapping keeps its data through MADV_DONTNEED.
        pages = mmap.mmap(-1, size, flags=private) if private else mmap.mmap(-1, size)
        host = np.frombuffer(pages, self._cache_type).reshape(shape)
        value = ort.OrtValue.ortvalue_from_numpy(host, self.device, 0)
        if self.device != "cpu":
            return name, value, None
        self._pages.append(pages)
        return name, value, host

    @property
    def position_bytes(self) -> int:
        """Cache bytes one position of one slot takes (keys and values of every layer)."""
        return len(self._caches) * self._row_bytes // self._positions_held

    def release(self, slot: int, keep: int = 0) -> None:
        """Roll the slot back to at most `keep` positions and hand the pages after them back to
        the system (`madvise(MADV_DONTNEED)`: they read as zeros when next touched), so the
        resident cache follows the sequences the slots hold, not the longest they ever held."""
        super().release(slot, keep)
        if self.device != "cpu" or self.by_head or not hasattr(mmap, "MADV_DONTNEED"):
            return
        # The slot's positions from `keep` on are one span: the cache is laid out by position.
        start = slot * self._row_bytes + keep * self._row_bytes // self._positions_held
        end = (slot + 1) * self._row_bytes
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only
        end = end // mmap.PAGESIZE * mmap.PAGESIZE
        if start < end:
            for pages in self._pages:
                pages.madvise(mmap.MADV_DONTNEED, start, end - start)

    @classmethod
    def from_bundle(
        cls, bundle: Bundle, role: str, backend: str = "onnxruntime", **options
    ) -> OrtEngine:
        r = bundle.role(role)
        slots = options.get("slots", 1)
        graphs = widest_for(r, backend, max(bundle.max_draft, bundle.max_lookup))
        if "providers" not in options:  # a test may run a GPU graph on the CPU's provider
            options["providers"] = providers_for(bundle, role, backend, slots, bool(graphs))
        options.setdefault("cuda_graphs", graphs)
        # Only the target's numbers decide the output; a draft may differ between call shapes.
        # The target's padding is probed unless the caller decides it (even_rows=True/False).
        probe = role == "target" and options.get("even_rows") is None
        options["even_rows"] = bool(options.get("even_rows"))
        if role == "target" and r.precision == "fp16" and backend == "onnxruntime":
            raise SpecrtError(
                f"{bundle.path}: the target is fp16, which is meant for GPU providers. On CPU, "
                "ONNX Runtime's fp16 kernels give logits that depend on how many tokens a call "
                "carries (measured: 2e-3), so speculation could not promise the target's own "
                "tokens; build the target as fp32, int8 or int4 for CPU"
            )
        engine = cls(
            r.graph_for(backend),
            num_layers=r.dim("num_layers"),
            num_kv_heads=r.dim("num_kv_heads"),
            head_dim=r.dim("head_dim"),
            vocab_size=r.dim("vocab_size"),
            capacity=bundle.max_context,
            margin=bundle.cache_margin,
            **options,
        )
        if probe:
            engine.probe_rows()
        return engine

    def forward(self, tokens: Sequence[int], last: int | None = None) -> np.ndarray:
        return self.forward_rows([(0, tokens)], last)[0]

    def forward_rows(self, rows: Sequence[RowCall], last: int | None = None) -> list[np.ndarray]:
        """A long row (a prompt, a draft model's catch-up) in pieces (see `_in_pieces`), any
        other call as one (see `_call`)."""
        if len(rows) == 1 and len(rows[0][1]) > PIECE:
            return [self._in_pieces(*rows[0], last)]
        return self._call(rows, last)

    def _in_pieces(self, slot: int, tokens: Sequence[int], last: int | None) -> np.ndarray:
        """One row's tokens fed PIECE at a time, keeping the logits of its last `last`. A
        call's attention holds a score for every pair of its tokens and the cache ([heads,
        width, total] floats a layer: 1.7 GB for 12 heads at 6,000 tokens), and ONNX Runtime's
        arena keeps its high-water mark. Pieces bound that, and were faster too; their logits
        equal the whole call's (the row probe holds every cut of a call to the same numbers)."""
        keep = self._check(slot, tokens, last)
        kept = []
        for start in range(0, len(tokens), PIECE):
            piece = tokens[start : start + PIECE]
            wanted = keep - (len(tokens) - start - len(piece))  # kept logits in this piece
            logits = self._call([(slot, piece)], max(1, min(wanted, len(piece))))[0]
            if wanted > 0:
                kept.append(logits)
        return np.concatenate(kept)

    def _call(self, rows: Sequence[RowCall], last: int | None) -> list[np.ndarray]:
        """One call over the slots from the lowest to the highest asked for (a slot's cache row
        is contiguous, so any such range binds in place). Each row's tokens go first and
        padding after (at its next positions, which no real token attends to and its next call
        overwrites); a slot in the range that was not asked for gets padding only and keeps its
        length.

        With even_rows the call carries an even number of rows in all. ONNX Runtime's
        MatMulNBits kernels (int8/int4/gguf) take activation rows in pairs and, on some CPUs
        (AVX2), give an odd last row to a one-row kernel whose results differ (measured on the
        int4 1.5B target: up to 0.3 in a logit). A position's logits would then depend on how
        calls are cut and batched, and a verify call of K+1 tokens would not reproduce one-token
        decoding. With every call even, every row goes through the pair kernel. `probe_rows`
        turns this on only where the machine needs it: a padding row is not free.
        """
        keeps = {slot: self._check(slot, tokens, last) for slot, tokens in rows}
        if len(keeps) < len(rows):
            raise ValueError("a batched call names a slot twice")
        calls = dict(rows)
        first, n = min(calls), max(calls) + 1 - min(calls)
        width = max(len(tokens) for tokens in calls.values())
        width += int(self.even_rows and n * width % 2 == 1)
        ids = np.zeros((n, width), np.int64)
        lengths = np.asarray(self._lengths[first : first + n], np.int64)
        positions = lengths[:, None] + np.arange(width)
        for slot, tokens in calls.items():
            ids[slot - first, : len(tokens)] = tokens
            ids[slot - first, len(tokens) :] = tokens[-1]
        total = int(positions[:, -1].max()) + 1
        if total > self._positions_held:
            raise SpecrtError(
                f"a call {width} tokens wide does not fit the cache margin of "
                f"{self._positions_held - self.capacity} positions"
            )
        # Row b keeps logits [count - keep, count); one slice of the call covers every row.
        skip = min(len(calls[slot]) - keep for slot, keep in keeps.items())
        out = self._run(ids, positions, total, width - skip, first)
        for slot, tokens in calls.items():
            self._wrote(slot, tokens)
        return [
            out[slot - first, len(tokens) - keeps[slot] - skip : len(tokens) - skip].astype(
                np.float32
            )
            for slot, tokens in rows
        ]

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        """Copy the rows' first positions in host memory; a device cache has no host copy
        and a cache by head no contiguous prefix (the caller then feeds the tokens)."""
        check_slot(self, source)
        check_slot(self, slot)
        check_rollback(self, length, source)
        if self.device != "cpu" or self.by_head:
            return False
        tokens = self.held(source)[:length]
        for _, _, host in self._caches:
            host[slot, :length] = host[source, :length]
        self._lengths[slot] = 0
        self._wrote(slot, tokens)
        return True

    def read_positions(self, slot: int, start: int, end: int) -> np.ndarray | None:
        """Every layer's keys and values at these positions, copied out of the slot's rows:
        [caches, end - start, kv_heads, head_dim] (the host prefix store keeps them)."""
        check_slot(self, slot)
        check_rollback(self, end, slot)
        if self.device != "cpu" or self.by_head:
            return None
        return np.stack([host[slot, start:end] for _, _, host in self._caches])

    def write_positions(self, slot: int, tokens: Sequence[int], data: np.ndarray) -> None:
        start = self._lengths[slot]
        check_room(self, len(tokens), None, slot)
        for (_, _, host), values in zip(self._caches, data, strict=True):
            host[slot, start : start + len(tokens)] = values
        self._wrote(slot, tokens)

    def _check(self, slot: int, tokens: Sequence[int], last: int | None) -> int:
        check_slot(self, slot)
        return check_room(self, len(tokens), last, slot)

    def _run(
        self, ids: np.ndarray, positions: np.ndarray, total: int, kept: int, first: int
    ) -> np.ndarray:
        n = ids.shape[0]
        bind = self._binding
        shape = [n, *self._row_shape]
        if self._in_place and n == 1:  # a lone row at exactly its length: read in place
            shape[1] = total
        width = shape[2] if self.by_head else shape[1]  # the positions bound
        call = (first, n, ids.shape[1], kept)
        if self._graphs is not None and self._graphs.captures(call):
            bind_whole = functools.partial(self._bind_whole, first)
            return self._graphs.run(call, ids, positions, bind_whole)
        if (first, n, width) != self._bound:  # n cache rows from slot `first`, in place
            self._bind_caches(bind, first, shape)
            self._bound = (first, n, width)
        if 1 < n <= self._view_rows:
            self._bind_views(bind, first, positions[:, -1] + 1)
        bind.bind_cpu_input("input_ids", ids)
        # A graph by head reads a mask as wide as its caches are bound.
        bind.bind_cpu_input("attention_mask", self._mask[:n, : width if self.by_head else total])
        bind.bind_cpu_input("position_ids", positions)
        bind.bind_cpu_input("logits_to_keep", np.array([kept], dtype=np.int64))
        size = n * kept * self.vocab_size
        if size > self._logits.size:
            self._logits = np.empty(size, self._logits_type)
        out = self._logits[:size].reshape(n, kept, self.vocab_size)
        bind.bind_output("logits", "cpu", 0, self._logits_type, list(out.shape), out.ctypes.data)
        self.session.run_with_iobinding(bind, self._graphs and self._graphs.eager)
        return out

    def _bind_caches(self, binding: ort.IOBinding, first: int, shape: list[int]) -> None:
        """Each layer's cache rows from slot `first` as its past input and present output."""
        offset = first * self._row_bytes
        for name, buffer, _ in self._caches:
            for bind_at, bound in (
                (binding.bind_input, name),
                (binding.bind_output, _present(name)),
            ):
                bind_at(bound, self.device, 0, self._cache_type, shape, buffer.data_ptr() + offset)

    def _bind_views(self, binding: ort.IOBinding, first: int, lengths: np.ndarray) -> None:
        """Each row's view of each cache, at the row's own length after this call (its past,
        its new tokens and their padding): what its attention reads, where it lies. Views of
        rows past the call keep an earlier call's binding; the graph does not read them."""
        rows = [
            ([1, length, *self._row_shape[1:]], (first + row) * self._row_bytes)
            for row, length in enumerate(lengths.tolist())
        ]
        for name, buffer, _ in self._caches:
            for row, (shape, offset) in enumerate(rows):
                address = buffer.data_ptr() + offset
                binding.bind_input(
                    row_view(name, row), self.device, 0, self._cache_type, shape, address
                )

    def _bind_whole(self, first: int, binding: ort.IOBinding, rows: int) -> list:
        """A captured call shape's caches, bound whole, and its mask, on the device."""
        self._bind_caches(binding, first, [rows, *self._row_shape])
        mask = ort.OrtValue.ortvalue_from_numpy(self._mask[:rows], self.device, 0)
        binding.bind_ortvalue_input("attention_mask", mask)
        return [mask]


def _session(graph: Path, providers: list, threads: int | None) -> ort.InferenceSession:
    """The graph's session on these providers, or a clear error (a corrupt graph, a provider
    that did not start)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or default_threads()
    options.inter_op_num_threads = 1
    # The draft and the target run in turn: a session's threads spin while it runs and stop
    # when its run ends, instead of spinning on the cores the other session needs. Measured
    # on 2 cores with an int4 pair: 19.6 tokens/s with ONNX Runtime's default, 32.5-34.3
    # with this (and 28-33 with spinning off altogether).
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Not a warning for each row view (an input with a default, which ONNX Runtime calls an
    # initializer it cannot fold): a CPU graph has 32 a layer, by design.
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(graph), options, providers=providers)
    except Exception as err:  # ORT raises its own types for corrupt or unloadable graphs
        raise SpecrtError(f"{graph}: ONNX Runtime cannot load this graph: {err}") from err
    check_providers(providers, session.get_providers())
    return session


def _present(past_name: str) -> str:
    """past_key_values.N.kind -> present.N.kind"""
    return past_name.replace("past_key_values", "present")
