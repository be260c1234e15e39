"""CUDA graphs for the hot calls: each decode or verify call shape is captured once by ONNX
Runtime and replayed after that.

On ONNX Runtime's CUDA provider a call launches a kernel or more per node, hundreds for a
28-layer model: the first H100 run measured ~11 ms a call whatever the model's size, launch
overhead rather than weights (issue 52). A CUDA graph replays a captured call's launches at
once. ONNX Runtime captures with the CUDA provider's `enable_cuda_graph` and the run option
`gpu_graph_id` (one graph per id; `-1` runs without one), provided that:

- the graph has no control flow and its CUDA partition no Memcpy node: the GPU graph
  (exporter/batched_attention.py; tests/test_gpu_engines.py checks both on a GPU);
- every input and output sits at the address, with the shape, it had when captured: each call
  shape gets device buffers of its own for the token ids, positions, mask and logits, bound
  once and refreshed in place before each replay; the caches, bound whole at their slots'
  fixed offsets, already do;
- what the host computes while capturing stays true: `logits_to_keep` and every size are baked
  into the graph, so a call shape is (first slot, rows, width, logits kept).

A prompt's pieces run without a graph (their widths vary and each runs once), and so does any
shape past `LIMIT` (each graph keeps device memory for its intermediates). ONNX Runtime runs a
shape's first calls normally and captures after them, so no call waits on a capture.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

LIMIT = 48  # captured call shapes per engine
EAGER = "-1"  # gpu_graph_id of a call that runs without a graph
Shape = tuple[int, int, int, int]  # first slot, rows, width, logits kept


@dataclass
class Captured:
    """One call shape's graph id and the buffers its graph was captured with (`held`: the
    others bound, kept alive as long as the graph may read them)."""

    options: ort.RunOptions
    binding: ort.IOBinding
    ids: ort.OrtValue
    positions: ort.OrtValue
    logits: ort.OrtValue
    held: list[ort.OrtValue]


def run_options(graph_id: str) -> ort.RunOptions:
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", graph_id)
    return options


class CudaGraphs:
    """The captured call shapes of one engine's session (whose CUDA provider was started with
    `enable_cuda_graph`). `widest`: the widest call captured (the verify window plus one)."""

    def __init__(self, session: ort.InferenceSession, device: str, widest: int, limit=LIMIT):
        self.session, self.device = session, device
        self.widest, self.limit = widest, limit
        self.shapes: dict[Shape, Captured] = {}
        self.eager = run_options(EAGER)  # for the engine's calls that run without one

    def captures(self, shape: Shape) -> bool:
        """Whether a call of this shape replays a graph: decode and verify widths, while
        fewer than `limit` shapes have one."""
        return shape[2] <= self.widest and (shape in self.shapes or len(self.shapes) < self.limit)

    def run(
        self,
        shape: Shape,
        ids: np.ndarray,
        positions: np.ndarray,
        bind: Callable[[ort.IOBinding, int], list],
    ) -> np.ndarray:
        """Run a call of this shape through its graph (binding its buffers the first time);
        `bind(binding, rows)` binds the caches and the mask for the shape's rows and returns
        the values it bound that must outlive the call."""
        captured = self.shapes.get(shape) or self._bind(shape, bind)
        captured.ids.update_inplace(ids)
        captured.positions.update_inplace(positions)
        self.session.run_with_iobinding(captured.binding, captured.options)
        return captured.logits.numpy()

    def _bind(self, shape: Shape, bind: Callable[[ort.IOBinding, int], list]) -> Captured:
        _, rows, width, kept = shape
        binding = self.session.io_binding()
        held = bind(binding, rows)
        ids, positions = (self._buffer([rows, width], np.int64) for _ in range(2))
        binding.bind_ortvalue_input("input_ids", ids)
        binding.bind_ortvalue_input("position_ids", positions)
        # Read by the host only (a size), so it lives there.
        held.append(ort.OrtValue.ortvalue_from_numpy(np.array([kept], np.int64)))
        binding.bind_ortvalue_input("logits_to_keep", held[-1])
        output = next(o for o in self.session.get_outputs() if o.name == "logits")
        dtype = np.float16 if output.type == "tensor(float16)" else np.float32
        logits = self._buffer([rows, kept, output.shape[-1]], dtype)
        binding.bind_ortvalue_output("logits", logits)
        options = run_options(str(len(self.shapes) + 1))  # 0 is ONNX Runtime's default id
        self.shapes[shape] = Captured(options, binding, ids, positions, logits, held)
        return self.shapes[shape]

    def _buffer(self, dims: list[int], dtype) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_shape_and_type(dims, dtype, self.device, 0)


def widest_for(role, backend: str, window: int) -> int:
    """The widest call an engine of this bundle role replays from a CUDA graph: the verify
    window plus one on `onnxruntime-cuda` where the role has a GPU graph; 0 (none) elsewhere,
    or where the environment says SPECRT_CUDA_GRAPHS=0 (to compare, or to step around)."""
    if os.environ.get("SPECRT_CUDA_GRAPHS", "1") == "0" or role.graph_for(backend) == role.graph:
        return 0
    return window + 1 if backend == "onnxruntime-cuda" else 0
