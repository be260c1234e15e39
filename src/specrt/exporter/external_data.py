"""The side file a graph's weights live in: page-aligned, written tensor by tensor (or band by
band), so no weight needs to be in memory with the rest and ONNX Runtime can memory-map them."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from onnx import TensorProto, helper

ALIGN = 4096  # page-aligned weights can be memory-mapped


class ExternalData:
    """Streams weights into one side file so the graph proto stays small."""

    def __init__(self, handle, location: str):
        self.handle = handle
        self.location = location
        self.offset = 0

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        return self.tensor_from_bands(name, [array])

    def tensor_from_bands(self, name: str, bands: Iterable[np.ndarray]) -> TensorProto:
        """One tensor written band by band along its first axis: only a band is in memory."""
        pad = (-self.offset) % ALIGN
        self.handle.write(b"\0" * pad)
        self.offset += pad
        start, rows, first = self.offset, 0, None
        for band in bands:
            band = np.ascontiguousarray(band)
            if first is None:
                first = band
            elif band.dtype != first.dtype or band.shape[1:] != first.shape[1:]:
                raise ValueError(f"{name}: bands of different shapes or types")
            self.handle.write(memoryview(band).cast("B") if band.nbytes else b"")
            self.offset += band.nbytes
            rows += band.shape[0] if band.ndim else 1
        if first is None:
            raise ValueError(f"{name}: no data")
        proto = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(first.dtype))
        proto.dims.extend((rows, *first.shape[1:]) if first.ndim else ())
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.location),
            ("offset", start),
            ("length", self.offset - start),
        ):
            proto.external_data.add(key=key, value=str(value))
        return proto
