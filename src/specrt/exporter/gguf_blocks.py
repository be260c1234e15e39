"""GGUF's quantized blocks as ONNX Runtime MatMulNBits weights, exactly.

A GGUF file's quantized tensors are the model llama.cpp runs. Re-quantizing their dequantized
values (what `int4` does) makes a second, lossier model; this module keeps the first one. Each
GGUF block type is written in a form MatMulNBits runs on its fast path (integer values, the
default zero point 2^(bits-1), one float scale per block), so that the graph's weights equal the
dequantized float32 weights up to float rounding of the scales:

    w[n, k] = scales[n, k // block] * (values[n, k] - 2^(bits-1)) - offsets[k // span, n]

- Q4_0, Q8_0, Q5_0, Q4_1, Q5_1, Q3_K and Q6_K fit with a shifted value (Q3_K as 4 bits and Q6_K
  as 8 bits in blocks of 16, their sub-blocks); the type-1 and K-quant minimums need `offsets`.
- IQ4_NL and IQ4_XS map each 4-bit code through a fixed table of 16 levels, so they take 8 bits
  (the level) in blocks of 32 with the block's scale.
- Q4_K and Q5_K (`w = d*sc*q - dmin*m` per 32 values) keep d*sc as the scale and q centred on the
  default zero point; what the centring and the minimum leave is one float per 32 inputs and
  output, applied as a small MatMul of the input's sums over each 32 values (`offsets`). Q2_K
  does the same per 16 values, its sub-block (`span` 16).

The default zero point matters: an explicit zero-point tensor takes a slower kernel, and a float
one is over 100x slower on CPU. Other types (the IQ1-IQ3 family) have no exact form here;
callers keep their own path for those and say so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
SUMS_BLOCK = 32  # offsets apply per this many inputs (the span), unless a type says otherwise


@dataclass(frozen=True)
class Blocks:
    """One weight [N outputs, K inputs] in MatMulNBits form."""

    kind: str  # the GGUF type, e.g. "Q4_K"
    bits: int
    block_size: int
    values: np.ndarray  # uint8 [N, K], centred on 2^(bits-1)
    scales: np.ndarray  # float32 [N, K // block_size]
    offsets: np.ndarray | None  # float32 [K // span, N], subtracted per span inputs; None: zero
    span: int = SUMS_BLOCK

    @property
    def form(self) -> str:
        extra = f" + offsets per {self.span} inputs" if self.offsets is not None else ""
        return f"{self.kind} as {self.bits} bits, block {self.block_size}{extra}"

    def dequantize(self) -> np.ndarray:
        """The float32 weight [N, K] this form computes (for the exactness check)."""
        n, k = self.values.shape
        centred = self.values.astype(np.float32) - 2 ** (self.bits - 1)
        w = (centred.reshape(n, -1, self.block_size) * self.scales[:, :, None]).reshape(n, k)
        if self.offsets is not None:
            w -= np.repeat(self.offsets.T, self.span, axis=1)
        return w

    def packed(self) -> np.ndarray:
        """B as MatMulNBits takes it: uint8 [N, K // block, block * bits / 8], low nibble first."""
        n, k = self.values.shape
        blocks = self.values.reshape(n, k // self.block_size, self.block_size)
        if self.bits == 8:
            return np.ascontiguousarray(blocks)
        return np.ascontiguousarray(blocks[..., 0::2] | (blocks[..., 1::2] << 4))


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
    if kind == "IQ4_NL":
        return IQ4_LEVELS[_nibbles(blocks[:, 2:18], 16).reshape(-1, 32)], d, None
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


def _k_quant(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (q [blocks, 8, 32], scale d*sc [blocks, 8], minimum dmin*m [blocks, 8])."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mins = _k_scales(blocks[:, 4:16])
    if kind == "Q4_K":
        q = _nibbles(blocks[:, 16:144], 32)
    else:
        low = _nibbles(blocks[:, 48:176], 32)
        high = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q = low | ((high & 1) << 4)
    return q.astype(np.int16), d * sc, dmin * mins


def _q2_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K: (q [blocks, 16, 16] in 0..3, scale d*sc [blocks, 16], minimum dmin*m [blocks, 16]);
    each 16-value sub-block's byte holds sc in its low nibble and m in its high one."""
    packed, qs = blocks[:, 0:16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    two = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    scale = d * (packed & 0x0F).astype(np.float32)
    return two.reshape(-1, 16, 16).astype(np.int16), scale, dmin * (packed >> 4).astype(np.float32)


def _q3_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K: (q [blocks, 16, 16] in -4..3, scale d*(sc - 32) [blocks, 16]). Two low bits per
    value in qs, a high bit in hmask that, when clear, takes 4 off; 16 6-bit scales packed as
    4 low bits in bytes 0-7 (low nibbles first) and 2 high bits in bytes 8-11."""
    hmask, qs, packed = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    low = _nibbles(packed[:, 0:8], 8).reshape(-1, 16)
    high = (packed[:, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    sc = (low | (high.reshape(-1, 16) << 4)).astype(np.float32) - 32
    two = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    top = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = two.reshape(-1, 16, 16).astype(np.int16) - 4 * (
        1 - top.reshape(-1, 16, 16).astype(np.int16)
    )
    return q, _f16(blocks[:, 108:110]) * sc


def _iq4_xs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_XS: (level [blocks, 8, 32], scale d*(ls - 32) [blocks, 8]); each 32-value sub-block's
    6-bit ls is 4 bits of scales_l (low nibble first) and 2 of the 16-bit scales_h."""
    high = blocks[:, 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)
    low = _nibbles(blocks[:, 4:8], 1).reshape(-1, 8)
    ls = low | ((high & 3).astype(np.uint8) << 4)
    levels = IQ4_LEVELS[_nibbles(blocks[:, 8:136], 16).reshape(-1, 8, 32)]
    return levels, _f16(blocks[:, 0:2]) * (ls.astype(np.float32) - 32)


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: (q - 32 [blocks, 16, 16], scale d*sc [blocks, 16])."""
    low = _nibbles(blocks[:, 0:128], 64).reshape(-1, 8, 32)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (low | ((high & 3).reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(-1, 16, 16), _f16(blocks[:, 208:210]) * scales


TYPE_SIZES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "IQ4_NL": 18}
K_TYPE_SIZES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
# llama.cpp's 16 levels of the IQ4 codes (kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
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
        return Blocks(
            kind, bits, 32, _values(q, centre, n, k), d.reshape(n, -1), _by_input(offsets, n)
        )
    if kind == "Q6_K":
        q, scale = _q6_k(raw.reshape(-1, K_TYPE_SIZES[kind]))
        return Blocks(kind, 8, 16, _values(q, 128, n, k), scale.reshape(n, -1), None)
    if kind == "Q2_K":  # w = s*q - m = s*((q + 8) - 8) - m, per 16 values
        q, scale, minimum = _q2_k(raw.reshape(-1, K_TYPE_SIZES[kind]))
        values, offsets = _values(q, 8, n, k), _by_input(minimum.reshape(-1), n)
        return Blocks(kind, 4, 16, values, scale.reshape(n, -1), offsets, span=16)
    if kind == "Q3_K":
        q, scale = _q3_k(raw.reshape(-1, K_TYPE_SIZES[kind]))
        return Blocks(kind, 4, 16, _values(q, 8, n, k), scale.reshape(n, -1), None)
    if kind == "IQ4_XS":
        q, scale = _iq4_xs(raw.reshape(-1, K_TYPE_SIZES[kind]))
        return Blocks(kind, 8, 32, _values(q, 128, n, k), scale.reshape(n, -1), None)
    if kind in K_TYPE_SIZES:
        q, scale, minimum = _k_quant(raw.reshape(-1, K_TYPE_SIZES[kind]), kind)
        bits = 4 if kind == "Q4_K" else 8
        half = 8 if kind == "Q4_K" else 16  # centre the 4 or 5 value bits
        # w = s*q - m = s*(q - half) - (m - half*s)
        offsets = (minimum - half * scale).reshape(-1)
        return Blocks(
            kind,
            bits,
            32,
            _values(q - half, 2 ** (bits - 1), n, k),
            scale.reshape(n, -1),
            _by_input(offsets, n),
        )
    raise ValueError(f"no exact MatMulNBits form for GGUF type {kind}")


def _values(q: np.ndarray, centre: int, n: int, k: int) -> np.ndarray:
    return (q + centre).astype(np.uint8).reshape(n, k)


def _by_input(offsets: np.ndarray | None, n: int) -> np.ndarray | None:
    """Per-(output, span inputs) offsets [N * K/span] -> [K/span, N] for the sums' MatMul."""
    if offsets is None:
        return None
    return np.ascontiguousarray(offsets.astype(np.float32).reshape(n, -1).T)


def row_permutation(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives llama's q/k when it loads a GGUF (llama.cpp stores them
    interleaved for its rotary kernel): weights[perm] is what the float32 model holds."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)
