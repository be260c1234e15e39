"""A model's weights, one tensor at a time, by their Hugging Face names.

The build never holds a whole model: it asks for one tensor (or a band of its rows), writes what
it becomes into the graph's side file, and lets it go. Each read maps or reads only what it
returns, so a tensor costs memory only while it is being converted (a map kept open would keep
every page it touched resident, and over a build add up to the whole checkpoint):

- a Hugging Face folder's safetensors, through `safe_open` opened per read (bf16/fp16 become
  float32 per band);
- a GGUF file, its metadata through gguf-py's reader, its rows read from the file and turned to
  float32 by gguf-py's own dequantizers, named by gguf-py's tensor-name map (the one
  transformers uses), with what its family's converter changed put back as transformers loads
  it (q/k rows interleaved, norms offset: `Family.gguf_interleaved_qk`, `Family.norm_offset`).
  Its quantized blocks stay reachable for the `gguf` precision.

Every array comes out float32, [rows, columns] as PyTorch's Linear holds it ([out, in]).
"""

from __future__ import annotations

import copy
import os
import re
from functools import cached_property
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.exporter.families import Family, family_of
from specrt.exporter.gguf_blocks import SUPPORTED, Blocks, row_permutation
from specrt.exporter.gguf_blocks import to_blocks as blocks_of
from specrt.sources import Source, load_config

Index = slice | np.ndarray
ROW_BAND = 4096  # rows converted at a time from a large tensor


class Tensors:
    """The weights of one model: `config` (a transformers PretrainedConfig), `shape(name)`,
    `rows(name, index)` and `get(name)` as float32, by Hugging Face name."""

    config = None

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def rows(self, name: str, index: Index) -> np.ndarray:
        """Rows of a tensor as float32: a slice, or an array of row numbers."""
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str) -> np.ndarray:
        if name not in self:
            raise SpecrtError(f"{self}: the weights have no tensor {name!r}")
        return self.rows(name, slice(None))

    def bands(self, name: str, band: int = ROW_BAND):
        """(start, float32 rows) over the tensor, band rows at a time: a large table (the
        embedding, the head) is never whole in float32 alongside its converted form."""
        count = self.shape(name)[0]
        for start in range(0, count, band):
            yield start, self.rows(name, slice(start, min(count, start + band)))

    def blocks(self, name: str, index: Index) -> Blocks | None:
        """The file's own quantized blocks of some rows of a weight, where the source has them
        (None: a float tensor, or a type with no exact form)."""
        return None

    def as_stored(self) -> Tensors:
        """The tensors under the names the checkpoint stores (what transformers loads), for the
        export check's reference: views that split or rename tensors return their base."""
        return self

    def kind(self, name: str) -> str:
        """The stored type of a tensor (a GGUF type name, or the safetensors dtype)."""
        raise NotImplementedError


class SafetensorsFolder(Tensors):
    """A Hugging Face folder: model.safetensors, or its shards (every *.safetensors file)."""

    def __init__(self, folder: Path, config):
        self.folder, self.config = Path(folder), config
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            found = ", ".join(p.name for p in self.folder.iterdir() if p.is_file())
            raise SpecrtError(
                f"{folder}: no .safetensors weights (found: {found}); save the model with "
                "save_pretrained(safe_serialization=True) to build from it"
            )
        self._info: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for path in files:
            self._info.update(self._read_header(path))

    def __str__(self) -> str:
        return str(self.folder)

    @staticmethod
    def _read_header(path: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
        """name -> (file, shape, dtype) of every tensor in one file."""
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as handle:
                slices = {name: handle.get_slice(name) for name in list(handle.keys())}
                return {n: (path, tuple(t.get_shape()), t.get_dtype()) for n, t in slices.items()}
        except Exception as err:  # safetensors raises its own error types
            raise SpecrtError(f"{path}: cannot read it as safetensors: {err}") from err

    def names(self) -> list[str]:
        return list(self._info)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][1]

    def kind(self, name: str) -> str:
        return self._info[name][2]

    def rows(self, name: str, index: Index) -> np.ndarray:
        """The file is mapped for this read only: pages of a map kept open would stay in the
        process's resident memory, and over a build add up to the whole checkpoint."""
        from safetensors import safe_open

        runs = [index] if isinstance(index, slice) else _runs(index)
        with safe_open(self._info[name][0], framework="pt") as handle:
            tensor = handle.get_slice(name)
            return np.concatenate([tensor[run].float().numpy() for run in runs])


class GgufFile(Tensors):
    """A GGUF file: tensors dequantized per band of rows, named as transformers names them."""

    def __init__(self, path: Path, config):
        from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

        self.path, self.config = Path(path), config
        try:
            self.reader = GGUFReader(self.path)
        except (OSError, ValueError) as err:
            raise SpecrtError(f"{path}: cannot read it as GGUF: {err}") from err
        field = self.reader.fields.get("general.architecture")
        if field is None:
            raise SpecrtError(f"{path}: GGUF metadata has no general.architecture")
        self.architecture = field.contents()
        arch = {name: key for key, name in MODEL_ARCH_NAMES.items()}.get(self.architecture)
        if arch is None:
            raise SpecrtError(f"{path}: gguf-py does not know architecture {self.architecture!r}")
        self._map = get_tensor_name_map(arch, config.num_hidden_layers)
        self._tensors = {t.name: t for t in self.reader.tensors}

    def __str__(self) -> str:
        return str(self.path)

    @cached_property
    def _family(self) -> Family:
        """Its family, which knows how llama.cpp's converter stored its weights."""
        return family_of(self.config)

    @cached_property
    def _names(self) -> dict[str, str]:
        """Hugging Face name -> GGUF name, for every tensor the file holds. A GGUF name may
        stand for two Hugging Face ones (ffn_up for up_proj and for Phi-3's fused
        gate_up_proj): the family's fused projections come first in _hf_stems and win."""
        stems: dict[str, str] = {}
        for hf in _hf_stems(self.config.num_hidden_layers, self._family.fused):
            stems.setdefault(self._map.get_name(hf), hf)
        names = {}
        for gguf_name in self._tensors:
            stem, _, suffix = gguf_name.rpartition(".")
            if stem in stems:
                names[f"{stems[stem]}.{suffix}"] = gguf_name
        return names

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def _tensor(self, name: str):
        if name not in self._names:
            raise SpecrtError(f"{self.path}: the GGUF file has no tensor for {name!r}")
        return self._tensors[self._names[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensor(name).shape))

    def kind(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def _order(self, name: str) -> np.ndarray | None:
        """Row order transformers gives llama's q/k (None: the file's own order)."""
        if self.architecture not in self._family.gguf_interleaved_qk:
            return None
        config = self.config
        heads = {
            "q_proj": config.num_attention_heads,
            "k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        }
        part = name.rsplit(".", 2)[-2]
        if part not in heads:
            return None
        return row_permutation(self.shape(name)[0], heads[part])

    def _raw(self, name: str, index: Index) -> np.ndarray:
        """The stored rows (quantized bytes, or floats) of a weight, in transformers' order.

        Read from the file, not through the reader's map: mapped pages once touched stay in the
        process's resident memory, and over a build would add up to the whole file."""
        tensor = self._tensor(name)
        count = len(tensor.data)
        order = self._order(name)
        picked = np.arange(count)[index] if order is None else order[index]
        row_shape, dtype = tensor.data.shape[1:], tensor.data.dtype
        row_bytes = tensor.n_bytes // count
        with open(self.path, "rb") as handle:
            parts = [
                os.pread(
                    handle.fileno(),
                    (run.stop - run.start) * row_bytes,
                    tensor.data_offset + run.start * row_bytes,
                )
                for run in _runs(picked)
            ]
        return np.frombuffer(b"".join(parts), dtype).reshape(len(picked), *row_shape)

    def rows(self, name: str, index: Index) -> np.ndarray:
        from gguf.quants import dequantize

        values = dequantize(self._raw(name, index), self._tensor(name).tensor_type)
        values = np.ascontiguousarray(values, dtype=np.float32)
        offset = self._family.norm_offset  # llama.cpp stores offset + w; transformers holds w
        if name.endswith("norm.weight") and offset:
            values = values - np.float32(offset)
        return values

    def blocks(self, name: str, index: Index) -> Blocks | None:
        kind = self.kind(name)
        if kind not in SUPPORTED:
            return None
        return blocks_of(kind, self._raw(name, index), self.shape(name)[1])


VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")


class Subset(Tensors):
    """Some layers and some vocabulary rows of a model, as a model of their own: what the export
    check runs, so that it holds a bounded part of a model of any size. Layer j is the model's
    layer layers[j]; token id j is the model's id vocab[j] (all ids when vocab is None)."""

    def __init__(self, base: Tensors, layers: list[int], vocab: np.ndarray | None):
        self.base, self.layers, self.vocab = base, layers, vocab
        config = copy.deepcopy(base.config)
        config.num_hidden_layers = len(layers)
        if vocab is not None:
            config.vocab_size = len(vocab)
            config.pad_token_id = None  # an id of the whole vocabulary, maybe not of the part
        if getattr(config, "layer_types", None):  # per-layer attention kinds follow the layers
            config.layer_types = [config.layer_types[i] for i in layers]
        self.config = config
        self._names = {self._name(name): name for name in base.names()}
        self._names.pop(None, None)

    def __str__(self) -> str:
        return f"{self.base} (layers {self.layers})"

    def _name(self, base_name: str) -> str | None:
        match = LAYER.match(base_name)
        if match is None:
            return base_name
        layer = int(match.group(1))
        if layer not in self.layers:
            return None
        return f"model.layers.{self.layers.index(layer)}.{match.group(2)}"

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def _index(self, name: str, index: Index) -> Index:
        if self.vocab is None or name not in VOCAB_TABLES:
            return index
        return self.vocab[index]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.base.shape(self._names[name])
        if self.vocab is not None and name in VOCAB_TABLES:
            return (len(self.vocab), *shape[1:])
        return shape

    def kind(self, name: str) -> str:
        return self.base.kind(self._names[name])

    def rows(self, name: str, index: Index) -> np.ndarray:
        return self.base.rows(self._names[name], self._index(name, index))

    def blocks(self, name: str, index: Index) -> Blocks | None:
        return self.base.blocks(self._names[name], self._index(name, index))

    def as_stored(self) -> Tensors:
        return Subset(self.base.as_stored(), self.layers, self.vocab)


class Unfused(Tensors):
    """A model whose family stores projections fused (`Family.fused`: Phi-3's qkv_proj and
    gate_up_proj), seen as the separate projections the graph writer reads: each is a band of
    the fused tensor's rows, in the family's order."""

    def __init__(self, base: Tensors):
        self.base, self.config = base, base.config
        config = base.config
        fused_parts = family_of(config).fused
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rows = {"q": heads * head_dim, "k": kv * head_dim, "v": kv * head_dim}
        rows |= {"gate": config.intermediate_size, "up": config.intermediate_size}
        self._parts: dict[str, tuple[str, int, int]] = {}  # name -> (fused name, start, rows)
        for name in base.names():
            stem, _, suffix = name.rpartition(".")
            module, _, fused = stem.rpartition(".")
            parent = module.rpartition(".")[2]
            if f"{parent}.{fused}" not in fused_parts:
                continue
            start = 0
            for part in fused_parts[f"{parent}.{fused}"]:
                self._parts[f"{module}.{part}_proj.{suffix}"] = (name, start, rows[part])
                start += rows[part]
        fused = {fused for fused, _, _ in self._parts.values()}
        self._names = [n for n in base.names() if n not in fused] + list(self._parts)

    def __str__(self) -> str:
        return str(self.base)

    def names(self) -> list[str]:
        return self._names

    def _where(self, name: str, index: Index) -> tuple[str, Index]:
        if name not in self._parts:
            return name, index
        fused, start, rows = self._parts[name]
        picked = np.arange(start, start + rows)[index]
        return fused, slice(int(picked[0]), int(picked[-1]) + 1) if _is_run(picked) else picked

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._parts:
            return self.base.shape(name)
        fused, _, rows = self._parts[name]
        return (rows, *self.base.shape(fused)[1:])

    def kind(self, name: str) -> str:
        return self.base.kind(self._parts.get(name, (name,))[0])

    def rows(self, name: str, index: Index) -> np.ndarray:
        return self.base.rows(*self._where(name, index))

    def blocks(self, name: str, index: Index) -> Blocks | None:
        return self.base.blocks(*self._where(name, index))

    def as_stored(self) -> Tensors:
        return self.base.as_stored()


def _is_run(index: np.ndarray) -> bool:
    return len(index) > 0 and bool((np.diff(index) == 1).all())


def unfused(tensors: Tensors) -> Tensors:
    """The tensors, with fused projections seen separately where the model has any."""
    view = Unfused(tensors)
    return view if view._parts else tensors


def open_weights(source: Source) -> Tensors:
    """The model's weights as memory-mapped tensors: what a build reads, one tensor at a time.
    A hub id is fetched first (its config and safetensors)."""
    config = load_config(source)
    if source.kind == "gguf":
        return unfused(GgufFile(Path(source.spec), config))
    folder = source.spec
    if source.kind == "hub":
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(source.spec, allow_patterns=["*.json", "*.safetensors"])
        except Exception as err:  # the hub client raises many kinds: offline, gated, missing
            raise SpecrtError(f"cannot fetch {source.spec} from the hub: {err}") from err
    return unfused(SafetensorsFolder(Path(folder), config))


def _hf_stems(layers: int, fused: dict[str, tuple[str, ...]]) -> list[str]:
    """Every Hugging Face module name a decoder of these families may hold, the family's fused
    projections first."""
    per_layer = [
        *fused,
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ]
    stems = ["model.embed_tokens", "model.norm", "lm_head"]
    return stems + [f"model.layers.{i}.{part}" for i in range(layers) for part in per_layer]


def _runs(index: np.ndarray) -> list[slice]:
    """Consecutive stretches of row numbers as slices (safetensors reads slices only)."""
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    return [slice(int(run[0]), int(run[-1]) + 1) for run in np.split(index, breaks)]
