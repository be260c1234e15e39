"""GGUF's quantized blocks as ONNX Runtime MatMulNBits weights, exactly.

A GGUF file's quantized tensors are the model llama.cpp runs. Re-quantizing their dequantized
values (what `int4` does) makes a second, lossier model; this module keeps the first one. Each
GGUF block type is written in a form MatMulNBits runs on its fast path (integer codes, one float
scale per block), so that the graph's weights equal the dequantized float32 weights up to float
rounding of the scales:

    w[n, k] = scales[n, k // block] * (codes[n, k] - zero) - shift[n, k // 32]

where `shift` is zero, the type-1 `offsets` or the K-quant `minimums`:

- Q4_0, Q8_0, Q5_0 and Q6_K need only a shifted code about the default zero point 2^(bits-1)
  (Q6_K as 8 bits in blocks of 16, its sub-block).
- Q4_K and Q5_K (`w = d*sc*q - dmin*m` per 32 values) keep q as the code with an explicit zero
  point of 0 and d*sc as the scale. Their minimums dmin*m are a second, small MatMulNBits over
  the input's sums of each 16 values: 8-bit codes m (each sub-block's twice, for its two sums),
  one block of 16 codes per 256-value super-block, whose dmin is that block's scale. Both are
  exact, and the minimums cost 5/8 of a bit a weight where a float32 table cost 1.
- Q4_1 and Q5_1 have a float minimum per 32 values: a float32 table `offsets` [K/32, N], applied
  as a MatMul of the input's sums over each 32 values.

Measured on a 2-core AVX-512 EPYC (benchmarks/gguf_forms.py): an explicit zero point costs
nothing at one row, a float zero point is over 100x slower, so codes stay integers. Other types
(Q2_K, Q3_K, the IQ family) have no exact form here; callers keep their own path for those and
say so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
SUMS_BLOCK = 32  # offsets apply per this many inputs
MINIMUM_SUMS = 16  # K-quant minimums take the input's sums over this many values
MINIMUM_CENTRE = 128  # MatMulNBits' default zero point for 8-bit codes


@dataclass(frozen=True)
class Minimums:
    """K-quant minimums dmin*m as an 8-bit MatMulNBits weight over the input's 16-value sums."""

    codes: np.ndarray  # uint8 [N, K // 256, 16]: 128 + m, each sub-block's m twice
    scales: np.ndarray  # float32 [N, K // 256]: each super-block's dmin

    def per_sub_block(self) -> np.ndarray:
        """dmin*m [N, K // 32], as gguf-py computes it (float32 dmin times float32 m)."""
        m = self.codes[..., ::2].astype(np.float32) - MINIMUM_CENTRE
        return (self.scales[..., None] * m).reshape(len(self.codes), -1)


@dataclass(frozen=True)
class Blocks:
    """One weight [N outputs, K inputs] in MatMulNBits form."""

    kind: str  # the GGUF type, e.g. "Q4_K"
    bits: int
    block_size: int
    values: np.ndarray  # uint8 [N, K]: the codes
    scales: np.ndarray  # float32 [N, K // block_size]
    zero: int  # the code that stands for 0: 2^(bits-1) (MatMulNBits' default) or 0 (explicit)
    offsets: np.ndarray | None = None  # float32 [K // 32, N], subtracted per 32 inputs
    minimums: Minimums | None = None  # subtracted per 32 inputs, through 16-value sums

    @property
    def form(self) -> str:
        extra = ""
        if self.offsets is not None:
            extra = " + offsets per 32 inputs"
        elif self.minimums is not None:
            extra = " from zero + 8-bit minimums over 16-input sums"
        return f"{self.kind} as {self.bits} bits, block {self.block_size}{extra}"

    def dequantize(self) -> np.ndarray:
        """The float32 weight [N, K] this form computes (for the exactness check)."""
        n, k = self.values.shape
        codes = self.values.astype(np.float32) - self.zero
        w = (self.scales[:, :, None] * codes.reshape(n, -1, self.block_size)).reshape(n, k)
        if self.offsets is not None:
            w -= np.repeat(self.offsets.T, SUMS_BLOCK, axis=1)
        if self.minimums is not None:
            w -= np.repeat(self.minimums.per_sub_block(), SUMS_BLOCK, axis=1)
        return w

    def packed(self) -> np.ndarray:
        """B as MatMulNBits takes it: uint8 [N, K // block, block * bits / 8], low nibble first."""
        n, k = self.values.shape
        return _pack(self.values.reshape(n, k // self.block_size, self.block_size), self.bits)

    def zero_points(self) -> np.ndarray | None:
        """MatMulNBits' explicit zero points (uint8 [N, ceil(blocks * bits / 8)]), or None for
        the default 2^(bits-1)."""
        if self.zero == 2 ** (self.bits - 1):
            return None
        n, k = self.values.shape
        zeros = np.full((n, k // self.block_size), self.zero, np.uint8)
        if self.bits == 4 and zeros.shape[1] % 2:
            zeros = np.pad(zeros, ((0, 0), (0, 1)))
        return _pack(zeros, self.bits)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., m] -> bytes, two 4-bit codes a byte low nibble first (8 bits: as is)."""
    if bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[..., m * width] bytes -> [..., 2m, width] values: each chunk's low nibbles, then high."""
    chunks = qs.reshape(*qs.shape[:-1], -1, 1, width) >> np.array([0, 4], np.uint8)[:, None]
    return (chunks & 0x0F).reshape(*qs.shape[:-1], -1, width)


def _bits32(raw: np.ndarray) -> np.ndarray:
    """[n, 4] bytes, one little-endian uint32 each -> its 32 bits [n, 32] (bit j: value j)."""
    word = np.ascontiguousarray(raw).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums of the 8 sub-blocks packed into 12 bytes (Q4_K, Q5_K)."""
    packed = raw.reshape(*raw.shape[:-1], 3, 4)
    d, m, md = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _simple(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Types with one scale per 32 values: (q [blocks, 32], scale d, minimum m or None), with
    w = d*q (+ m). Type-0 q comes already minus the type's own zero point."""
    d = _f16(blocks[:, 0:2])[:, 0]
    minimum = _f16(blocks[:, 2:4])[:, 0] if kind in ("Q4_1", "Q5_1") else None
    if kind == "Q8_0":
        return blocks[:, 2:34].view(np.int8).astype(np.int16), d, None
    if kind in ("Q4_0", "Q4_1"):
        start = 2 if kind == "Q4_0" else 4
        q = _nibbles(blocks[:, start : start + 16], 16).reshape(-1, 32).astype(np.int16)
        return (q - 8 if minimum is None else q), d, minimum
    start = 2 if kind == "Q5_0" else 4
    low = _nibbles(blocks[:, start + 4 : start + 20], 16).reshape(-1, 32)
    q = (low | (_bits32(blocks[:, start : start + 4]) << 4)).astype(np.int16)
    return (q - 16 if minimum is None else q), d, minimum


def _k_quant(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, Minimums]:
    """Q4_K / Q5_K: (q [blocks, 8, 32], scale d*sc [blocks, 8], minimums) for one row's
    worth of super-blocks at a time (the caller reshapes by rows)."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mins = _k_scales(blocks[:, 4:16])
    if kind == "Q4_K":
        q = _nibbles(blocks[:, 16:144], 32)
    else:
        low = _nibbles(blocks[:, 48:176], 32)
        high = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q = low | ((high & 1) << 4)
    codes = np.repeat(mins.astype(np.uint8) + MINIMUM_CENTRE, MINIMUM_SUMS // 8, axis=-1)
    return q, d * sc, Minimums(codes, dmin[:, 0])


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: (q - 32 [blocks, 16, 16], scale d*sc [blocks, 16])."""
    low = _nibbles(blocks[:, 0:128], 64).reshape(-1, 8, 32)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (low | ((high & 3).reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(-1, 16, 16), _f16(blocks[:, 208:210]) * scales


TYPE_SIZES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
K_TYPE_SIZES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
SUPPORTED = tuple(TYPE_SIZES) + tuple(K_TYPE_SIZES)


def to_blocks(kind: str, raw: np.ndarray, k: int) -> Blocks:
    """Convert one tensor's raw GGUF rows (uint8 [N, row bytes]) of type `kind`, K inputs each."""
    n = raw.shape[0]
    if kind in TYPE_SIZES:
        q, d, minimum = _simple(raw.reshape(-1, TYPE_SIZES[kind]), kind)
        bits = 4 if kind in ("Q4_0", "Q4_1") else 8
        centre = 2 ** (bits - 1)
        offsets = None
        if minimum is not None:  # w = d*q + m = d*(q - c) + (c*d + m)
            offsets = -(centre * d + minimum)
            q = q - centre
        values = _values(q, centre, n, k)
        return Blocks(kind, bits, 32, values, d.reshape(n, -1), centre, _by_input(offsets, n))
    if kind == "Q6_K":
        q, scale = _q6_k(raw.reshape(-1, K_TYPE_SIZES[kind]))
        return Blocks(kind, 8, 16, _values(q, 128, n, k), scale.reshape(n, -1), 128)
    if kind in K_TYPE_SIZES:
        q, scale, minimums = _k_quant(raw.reshape(-1, K_TYPE_SIZES[kind]), kind)
        per_row = Minimums(
            minimums.codes.reshape(n, k // QK_K, MINIMUM_SUMS), minimums.scales.reshape(n, -1)
        )
        bits = 4 if kind == "Q4_K" else 8
        return Blocks(
            kind, bits, 32, q.reshape(n, k).astype(np.uint8), scale.reshape(n, -1), 0, None, per_row
        )
    raise ValueError(f"no exact MatMulNBits form for GGUF type {kind}")


def _values(q: np.ndarray, centre: int, n: int, k: int) -> np.ndarray:
    return (q + centre).astype(np.uint8).reshape(n, k)


def _by_input(offsets: np.ndarray | None, n: int) -> np.ndarray | None:
    """Per-(output, 32 inputs) offsets [N * K/32] -> [K/32, N] for the sums' MatMul."""
    if offsets is None:
        return None
    return np.ascontiguousarray(offsets.astype(np.float32).reshape(n, -1).T)


def row_permutation(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives llama's q/k when it loads a GGUF (llama.cpp stores them
    interleaved for its rotary kernel): weights[perm] is what the float32 model holds."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)
