"""GGUF files (llama.cpp): the config rebuilt from metadata, tensors under Hugging Face names.

The config comes from the header alone (``tokenmill.gguf_metadata``: keys,
values and the tensor index, parsed in milliseconds); ``gguf.GGUFReader``
memory-maps the file only when tensor data is read, and tensors are decoded one at a time
(``gguf_tensors``). Each architecture's table (``gguf_architectures``) names its
tensors and undoes what the converter did to them (the q/k row permutation of
``llama``, Gemma's norms stored as ``1 + weight``, experts stacked into one
tensor), so that every tensor equals the original checkpoint's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.gguf_metadata import GGUFError, GGUFMetadata, TensorInfo, has_gguf_magic, open_gguf
from tokenmill.weights.format import LoadedTensor, WeightsError
from tokenmill.weights.gguf_architectures import ARCHITECTURES, EXPERT, GGUFArchitecture, gguf_architecture
from tokenmill.weights.gguf_rope import (
    LONGROPE_TENSORS,
    ROPE_FREQS_TENSOR,
    longrope_scaling,
    rope_scaling_from_freqs,
    rope_scaling_from_metadata,
)
from tokenmill.weights.gguf_tensors import can_decode, decode, hf_tensor_name, unpermute_qk_rows

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderTensor

logger = logging.getLogger(__name__)

#: Tensors that hold rope parameters, read into the config rather than the model.
_ROPE_TENSORS = frozenset({ROPE_FREQS_TENSOR, *LONGROPE_TENSORS})

_TOKEN_ID_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}


def _error(file: Path, problem: str, tensor: str | None = None) -> WeightsError:
    where = f"{file}: tensor {tensor!r}" if tensor is not None else str(file)
    return WeightsError(f"{where}: {' '.join(str(problem).split())}")


@dataclass
class _GGUFFile:
    """One opened file: its header, the values both read_config and iter_tensors need, and a reader of its
    tensor data, opened on first use."""

    file: Path
    metadata: GGUFMetadata
    open_reader: Callable[[], GGUFReader]
    arch: str = ""
    spec: GGUFArchitecture = ARCHITECTURES["llama"]
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    _reader: GGUFReader | None = None

    @property
    def reader(self) -> GGUFReader:
        """``gguf.GGUFReader`` over the file, for tensor data (parsing its header takes seconds)."""
        if self._reader is None:
            self._reader = self.open_reader()
        return self._reader

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self.metadata.get(key, default)
        except GGUFError as exc:
            raise _error(self.file, exc.reason) from exc

    def require_int(self, key: str) -> int:
        value = self.get(key)
        if value is None:
            raise _error(self.file, f"metadata key {key!r} is missing")
        if isinstance(value, list):
            raise _error(self.file, f"metadata key {key!r} has per-layer values, which are not supported")
        return int(value)

    def get_arch(self, key: str) -> Any:
        """``{arch}.{key}``'s value, or None."""
        return self.get(f"{self.arch}.{key}")

    def tensors(self) -> dict[str, TensorInfo]:
        return self.metadata.tensors

    def _tensor_values(self, name: str) -> Any:
        tensor = next(tensor for tensor in self.reader.tensors if tensor.name == name)
        return decode(tensor).double().numpy()

    def rope_scaling(self) -> dict[str, Any] | None:
        """From metadata, from llama.cpp's ``rope_freqs`` tensor (Llama 3.x) or from its LongRoPE factor tensors
        (Phi-3); metadata and ``rope_freqs`` at once is refused."""
        from_metadata = rope_scaling_from_metadata(self.get, self.arch)
        if any(name in self.tensors() for name in LONGROPE_TENSORS):
            try:
                if not all(name in self.tensors() for name in LONGROPE_TENSORS):
                    raise ValueError(f"needs both tensors {' and '.join(LONGROPE_TENSORS)}")
                long_factor, short_factor = (self._tensor_values(name) for name in LONGROPE_TENSORS)
                return longrope_scaling(long_factor, short_factor, self.get, self.arch)
            except (ValueError, RuntimeError, NotImplementedError) as exc:
                raise _error(self.file, f"LongRoPE factors: {exc}") from exc
        if ROPE_FREQS_TENSOR not in self.tensors():
            return from_metadata
        try:
            freqs = self._tensor_values(ROPE_FREQS_TENSOR)
            from_freqs = rope_scaling_from_freqs(freqs, self.head_dim, self.rope_theta)
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            raise _error(self.file, str(exc), ROPE_FREQS_TENSOR) from exc
        if from_freqs is not None and from_metadata is not None:
            raise _error(self.file, "rope scaling both in metadata and in this tensor", ROPE_FREQS_TENSOR)
        return from_freqs or from_metadata


class GGUFFormat:
    """Reads a single-file GGUF model of an architecture in ``ARCHITECTURES`` (or Mixtral, written as ``llama``)."""

    name: ClassVar[str] = "gguf"

    def __init__(self) -> None:
        # read_config and iter_tensors open the same file back to back: keep the last one, so that the
        # tensor reader (seconds to open) is opened at most once per load.
        self._cached: tuple[tuple[str, int, int], _GGUFFile] | None = None

    def can_load(self, path: Path) -> bool:
        return has_gguf_magic(path)

    def read_config(self, path: Path) -> dict[str, Any]:
        source = self._open(Path(path), keep=True)
        arch, spec = source.arch, source.spec
        tensors = source.tensors()
        config: dict[str, Any] = {
            "architectures": [spec.hf_class],
            "model_type": spec.model_type,
            "hidden_size": source.require_int(f"{arch}.embedding_length"),
            "intermediate_size": source.require_int(f"{arch}.feed_forward_length"),
            "num_hidden_layers": source.require_int(f"{arch}.block_count"),
            "num_attention_heads": source.num_heads,
            "num_key_value_heads": source.num_kv_heads,
            "head_dim": source.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": float(source.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": source.rope_theta,
            "max_position_embeddings": source.require_int(f"{arch}.context_length"),
            "vocab_size": self._vocab_size(source, tensors),
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in tensors,
            "tie_word_embeddings": "output.weight" not in tensors,
            "torch_dtype": "float32",
        }
        weight_type = _linear_weight_type(tensors)
        if weight_type is not None:
            # Not a Hugging Face quantization scheme: tells `quantization = "auto"` how the file stores
            # its linear layers, so that it can keep them in a format that holds them exactly.
            config["quantization_config"] = {"quant_method": "gguf", "weight_type": weight_type}
        rope_scaling = source.rope_scaling()
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        original_context = source.get(f"{arch}.rope.scaling.original_context_length")
        if original_context:  # Phi-3 states it with or without LongRoPE
            config["original_max_position_embeddings"] = int(original_context)
        rope_dims = source.get(f"{arch}.rope.dimension_count")
        if rope_dims and int(rope_dims) < source.head_dim:  # llama.cpp rotates the first rope_dims of each head
            config["partial_rotary_factor"] = int(rope_dims) / source.head_dim
        sliding_window = source.get(f"{arch}.attention.sliding_window")
        if sliding_window:
            config["sliding_window"] = int(sliding_window)
        try:
            config.update(spec.extras(source.get_arch, config))
        except ValueError as exc:
            raise _error(source.file, str(exc)) from exc
        for hf_key, gguf_key in _TOKEN_ID_KEYS.items():
            value = source.get(gguf_key)
            if value is not None:
                config[hf_key] = int(value)
        return config

    def iter_tensors(self, path: Path) -> Iterator[LoadedTensor]:
        source = self._open(Path(path), keep=False)
        file, spec = source.file, source.spec
        qk_heads = {"attn_q": source.num_heads, "attn_k": source.num_kv_heads}
        # Check every tensor's name and type before decoding any of them.
        plan: list[tuple[ReaderTensor, str]] = []
        for tensor in source.reader.tensors:
            if tensor.name in _ROPE_TENSORS:
                source.rope_scaling()  # raises unless read_config can express it as rope_scaling
                continue
            hf_name = hf_tensor_name(tensor.name, spec.layer_names)
            if hf_name is None:
                raise _error(file, "no Hugging Face equivalent for this GGUF tensor name", tensor.name)
            if not can_decode(tensor):
                raise _error(file, f"unsupported tensor type {tensor.tensor_type.name}", tensor.name)
            if EXPERT in hf_name and len(tensor.shape) != 3:
                raise _error(
                    file, f"expected experts stacked in 3 dimensions, got shape {list(tensor.shape)}", tensor.name
                )
            plan.append((tensor, hf_name))
        logger.debug("%s: %d tensors, architecture %s", file, len(plan), source.arch)

        for tensor, hf_name in plan:
            value = self._decode(file, tensor)
            base, kind = tensor.name.split(".")[-2:]
            if spec.permutes_qk and base in qk_heads:
                heads = qk_heads[base]
                if value.shape[0] % (2 * heads) != 0:
                    raise _error(file, f"{value.shape[0]} rows do not split into {heads} heads", tensor.name)
                value = unpermute_qk_rows(value, heads)
            if spec.norm_offset and base.endswith("norm") and kind == "weight":
                value = value - spec.norm_offset
            if EXPERT in hf_name:  # [num_experts, rows, cols]: one checkpoint tensor per expert
                for expert, expert_value in enumerate(value.unbind(0)):
                    yield LoadedTensor(hf_name.replace(EXPERT, str(expert)), expert_value, file)
            else:
                yield LoadedTensor(hf_name, value, file)

    # ------------------------------------------------------------------ helpers

    def _open(self, file: Path, keep: bool) -> _GGUFFile:
        """Open ``file`` (reusing the last one if the file is unchanged); ``keep`` keeps it for the next call."""
        try:
            stat = os.stat(file)
        except OSError as exc:
            raise _error(file, f"cannot read: {exc.strerror or exc}") from exc
        key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
        cached, self._cached = self._cached, None
        source = cached[1] if cached is not None and cached[0] == key else self._parse(file)
        if keep:
            self._cached = (key, source)
        return source

    def _parse(self, file: Path) -> _GGUFFile:
        try:
            metadata = GGUFMetadata.open(file)
        except GGUFError as exc:
            raise _error(file, exc.reason) from exc
        source = _GGUFFile(file, metadata, lambda: self._tensor_reader(file))
        split_count = source.get("split.count", 1)
        if split_count and int(split_count) > 1:
            raise _error(
                file, f"split GGUF ({split_count} files) is not supported; merge with llama-gguf-split --merge"
            )
        arch = source.get("general.architecture")
        if arch is None:
            raise _error(file, "metadata key 'general.architecture' is missing")
        source.arch = arch
        spec = gguf_architecture(arch, source.get_arch)
        if spec is None:
            raise _error(file, f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        source.spec = spec
        source.num_heads = source.require_int(f"{arch}.attention.head_count")
        kv_key = f"{arch}.attention.head_count_kv"
        source.num_kv_heads = source.require_int(kv_key) if kv_key in source.metadata else source.num_heads
        hidden_size = source.require_int(f"{arch}.embedding_length")
        # As llama.cpp: a head is key_length wide, or hidden / heads; rope.dimension_count is how much of it rotates.
        source.head_dim = int(source.get(f"{arch}.attention.key_length") or hidden_size // source.num_heads)
        source.rope_theta = float(source.get(f"{arch}.rope.freq_base", 10000.0))
        return source

    @staticmethod
    def _tensor_reader(file: Path) -> GGUFReader:
        try:
            reader = open_gguf(file)
        except GGUFError as exc:
            raise _error(file, exc.reason) from exc
        if reader.byte_order != "I":
            raise _error(file, "GGUF file has the opposite byte order of this machine; not supported")
        return reader

    def _vocab_size(self, source: _GGUFFile, tensors: dict[str, TensorInfo]) -> int:
        vocab_size = source.get(f"{source.arch}.vocab_size")
        if vocab_size is not None:
            return int(vocab_size)
        # The embedding's rows are what the model's shapes must match; the token list comes next.
        embedding = tensors.get("token_embd.weight")
        if embedding is not None and len(embedding.shape) == 2:
            return int(embedding.shape[1])
        num_tokens = source.metadata.num_items("tokenizer.ggml.tokens")
        if num_tokens:
            return num_tokens
        raise _error(source.file, "cannot tell the vocabulary size: no vocab_size key, token_embd or token list")

    def _decode(self, file: Path, tensor: ReaderTensor) -> torch.Tensor:
        try:
            return decode(tensor)
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            problem = f"cannot decode {tensor.tensor_type.name} data: {type(exc).__name__}: {exc}"
            raise _error(file, problem, tensor.name) from exc


def _linear_weight_type(tensors: dict[str, TensorInfo]) -> str | None:
    """The storage type of most transformer-block matrices (``"Q4_1"``), or None when they are float."""
    from collections import Counter

    counts = Counter(  # matrices, and experts' matrices stacked in three dimensions
        tensor.tensor_type.name
        for name, tensor in tensors.items()
        if name.startswith("blk.") and name.endswith(".weight") and len(tensor.shape) in (2, 3)
    )
    if not counts:
        return None
    weight_type = counts.most_common(1)[0][0]
    return None if weight_type in ("F32", "F16", "BF16") else weight_type
