"""Medusa heads: their checkpoint format, read and written here, and their ResBlocks.

A Medusa head (Cai et al. 2024, https://github.com/FasterDecoding/Medusa) reads the target model's final
hidden state ``h`` (after its last norm) at the position whose logits gave token ``t``, and predicts token
``t + 1 + i`` (head ``i``, 0-based; the model's own lm_head at that position predicted ``t``)::

    head_i(h) = ResBlock_i,L-1(... ResBlock_i,0(h)) @ W_i.T        ResBlock(x) = x + SiLU(x @ A.T + b)

The format, as FasterDecoding's ``medusa/model/medusa_model.py`` and ``medusa/train/train_legacy.py`` write it
(and Hugging Face TGI reads it), is a directory holding

- ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path``
  (``write_medusa_heads`` adds ``hidden_size`` and ``vocab_size``, which vLLM's Medusa config reads);
- ``medusa_lm_head.safetensors`` (older checkpoints: ``medusa_lm_head.pt``, a torch state dict) with, for
  head ``i`` and ResBlock ``j`` < L, ``"{i}.{j}.linear.weight"`` [hidden, hidden] and ``"{i}.{j}.linear.bias"``
  [hidden]; and, when the head has a vocabulary projection of its own, ``"{i}.{L}.weight"`` [vocab, hidden]
  (Medusa-1's ``medusa_model.py``: ``nn.Sequential(*[ResBlock] * L, nn.Linear(hidden, vocab, bias=False))``).
  Checkpoints of ``train_legacy.py`` (``"version": "2"``) hold no projection: their heads use the base
  model's lm_head, and so do ``tokenmill train medusa``'s.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tokenmill.model_loader import LoadedModel, select_weight_format
from tokenmill.plugin_manager import PluginSystem
from tokenmill.weights.format import WeightsError

__all__ = [
    "CONFIG_FILE",
    "DRAFT_VOCAB",
    "MEDUSA_CHOICES",
    "WEIGHTS_FILE",
    "MedusaHeads",
    "apply_resblocks",
    "output_projection",
    "read_medusa_config",
    "read_medusa_heads",
    "write_medusa_heads",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
#: config.json key of a draft vocabulary (our addition, after FR-Spec, Zhao et al. 2025): the token ids the heads
#: score, most frequent first; heads then read only those rows of their projection. Absent: the whole vocabulary.
DRAFT_VOCAB = "draft_vocab"
#: config.json key of the draft tree to verify with these heads (our addition; Medusa's own name for a tree's
#: node list): a list of rank paths, as ``speculative_config.speculative_token_tree``.
MEDUSA_CHOICES = "medusa_choices"
WEIGHTS_FILE = "medusa_lm_head.safetensors"
_LEGACY_WEIGHTS_FILE = "medusa_lm_head.pt"
_RESBLOCK_KEY = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_PROJECTION_KEY = re.compile(r"(\d+)\.(\d+)\.weight")


@dataclass(frozen=True)
class MedusaHeads:
    """Medusa heads as a checkpoint stores them (float tensors on the CPU, in the stored dtype)."""

    directory: Path
    config: dict[str, Any]  # config.json as read
    weights: torch.Tensor  # [num_heads, num_layers, hidden_size, hidden_size]: each ResBlock's linear weight
    biases: torch.Tensor  # [num_heads, num_layers, hidden_size]
    #: Per head, its vocabulary projection [vocab_size, hidden_size], or None: the base model's lm_head.
    projections: list[torch.Tensor | None]
    num_stored_heads: int  # heads in the checkpoint; ``weights`` may hold only the first few

    @property
    def num_heads(self) -> int:
        return self.weights.shape[0]

    @property
    def num_layers(self) -> int:
        return self.weights.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.weights.shape[2]


def apply_resblocks(hidden: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """Every head's ResBlocks over ``hidden`` [num_rows, hidden_size], all heads in one batched matmul per
    layer: returns [num_heads, num_rows, hidden_size], the input of each head's vocabulary projection.
    ``weights`` [num_heads, num_layers, hidden, hidden] and ``biases`` [num_heads, num_layers, hidden]."""
    x = hidden.unsqueeze(0).expand(weights.shape[0], -1, -1)  # [num_heads, num_rows, hidden]
    for layer in range(weights.shape[1]):
        x = x + F.silu(torch.baddbmm(biases[:, layer].unsqueeze(1), x, weights[:, layer].transpose(1, 2)))
    return x


def read_medusa_config(directory: Path) -> dict[str, Any]:
    """The heads' ``config.json``. Raises ``WeightsError`` (one line) when ``directory`` is not a directory
    holding a readable JSON object there."""
    directory = Path(directory)
    if not directory.is_dir():
        raise WeightsError(f"{directory}: not a directory of Medusa heads ({CONFIG_FILE} and {WEIGHTS_FILE})")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise WeightsError(
            f"{directory}: no {CONFIG_FILE}; a Medusa heads directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{config_path}: cannot read: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{config_path}: expected a JSON object")
    return config


def read_medusa_heads(directory: Path, num_heads: int | None = None) -> MedusaHeads:
    """Read the Medusa heads in ``directory`` (the first ``num_heads`` of them, or all).

    Raises ``WeightsError`` (one line, naming the file) for a missing file, a tensor name outside the
    format, a head missing a tensor, or shapes that disagree with each other or with config.json.
    """
    directory = Path(directory)
    config = read_medusa_config(directory)
    config_path = directory / CONFIG_FILE
    weights_path, tensor_names = _open_weights(directory)
    layers: dict[int, set[int]] = {}
    projection_index: dict[int, int] = {}
    for key in tensor_names:
        if match := _RESBLOCK_KEY.fullmatch(key):
            layers.setdefault(int(match[1]), set()).add(int(match[2]))
        elif match := _PROJECTION_KEY.fullmatch(key):
            projection_index[int(match[1])] = int(match[2])
        else:
            raise WeightsError(
                f"{weights_path}: tensor {key!r} is not part of a Medusa head "
                "(expected '<head>.<layer>.linear.weight/bias' or '<head>.<layers>.weight')"
            )
    head_ids = sorted(layers.keys() | projection_index.keys())
    if not head_ids:
        raise WeightsError(f"{weights_path}: holds no Medusa heads")
    if head_ids != list(range(len(head_ids))):
        missing = min(set(range(head_ids[-1] + 1)) - set(head_ids))
        raise WeightsError(f"{weights_path}: heads are numbered up to {head_ids[-1]} but head {missing} is missing")
    num_layers = len(layers.get(0, ()))
    for head in head_ids:
        if layers.get(head, set()) != set(range(num_layers)):
            raise WeightsError(
                f"{weights_path}: head {head} has ResBlocks {sorted(layers.get(head, ()))}, head 0 "
                f"has {list(range(num_layers))}"
            )
        if projection_index.get(head, num_layers) != num_layers:
            raise WeightsError(
                f"{weights_path}: tensor '{head}.{projection_index[head]}.weight' should be "
                f"'{head}.{num_layers}.weight', the projection after {num_layers} ResBlocks"
            )
    configured = config.get("medusa_num_heads", config.get("num_heads"))
    if isinstance(configured, int) and configured != len(head_ids):
        # FasterDecoding's published medusa-vicuna-7b-v1.3 says 2 heads and holds 5; its loader trusts the weights.
        logger.info(
            "%s: config.json says %d heads, %s holds %d; using the weights",
            directory,
            configured,
            weights_path.name,
            len(head_ids),
        )
    num_read = len(head_ids) if num_heads is None else min(num_heads, len(head_ids))
    weights, biases, projections = _read_tensors(weights_path, num_read, num_layers)
    heads = MedusaHeads(directory, config, weights, biases, projections, len(head_ids))
    _check_config_sizes(heads, config_path)
    return heads


def _open_weights(directory: Path) -> tuple[Path, list[str]]:
    """The weights file and the names of its tensors."""
    for name in (WEIGHTS_FILE, _LEGACY_WEIGHTS_FILE):
        path = directory / name
        if path.is_file():
            if path.suffix != ".safetensors":
                return path, list(_load_tensors(path, None))
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    return path, list(f.keys())
            except (SafetensorError, OSError) as exc:
                raise WeightsError(f"{path}: cannot read: {' '.join(str(exc).split())}") from None
    raise WeightsError(f"{directory}: no {WEIGHTS_FILE} (or {_LEGACY_WEIGHTS_FILE}) with the Medusa heads")


def _load_tensors(path: Path, keys: set[str] | None) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` named in ``keys`` (all when None)."""
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return {key: f.get_tensor(key) for key in f.keys() if keys is None or key in keys}
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError) as exc:
        raise WeightsError(f"{path}: cannot read: {' '.join(str(exc).split())}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path}: expected a state dict of tensors")
    return {key: value for key, value in state.items() if keys is None or key in keys}


def _read_tensors(
    path: Path, num_heads: int, num_layers: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    keys = {f"{head}.{num_layers}.weight" for head in range(num_heads)}
    for head in range(num_heads):
        keys |= {f"{head}.{layer}.linear.{kind}" for layer in range(num_layers) for kind in ("weight", "bias")}
    tensors = _load_tensors(path, keys)
    first = tensors["0.0.linear.weight"] if num_layers else tensors["0.0.weight"]
    hidden_size = first.shape[-1]
    weights = torch.empty(num_heads, num_layers, hidden_size, hidden_size, dtype=first.dtype)
    biases = torch.empty(num_heads, num_layers, hidden_size, dtype=first.dtype)
    projections: list[torch.Tensor | None] = []
    for head in range(num_heads):
        for layer in range(num_layers):
            prefix = f"{head}.{layer}.linear"
            weights[head, layer] = _tensor(tensors, f"{prefix}.weight", (hidden_size, hidden_size), path)
            biases[head, layer] = _tensor(tensors, f"{prefix}.bias", (hidden_size,), path)
        projection = tensors.get(f"{head}.{num_layers}.weight")
        if projection is not None and (projection.dim() != 2 or projection.shape[1] != hidden_size):
            raise WeightsError(
                f"{path}: tensor '{head}.{num_layers}.weight' has shape {list(projection.shape)}, "
                f"expected [vocab_size, {hidden_size}]"
            )
        projections.append(projection)
    return weights, biases, projections


def _tensor(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], path: Path) -> torch.Tensor:
    tensor = tensors.get(key)
    if tensor is None:
        raise WeightsError(f"{path}: tensor {key!r} is missing")
    if tuple(tensor.shape) != shape:
        raise WeightsError(f"{path}: tensor {key!r} has shape {list(tensor.shape)}, expected {list(shape)}")
    if not tensor.is_floating_point():
        raise WeightsError(f"{path}: tensor {key!r} is {tensor.dtype}, expected a float tensor")
    return tensor


def _check_config_sizes(heads: MedusaHeads, config_path: Path) -> None:
    hidden_size = heads.config.get("hidden_size")
    if isinstance(hidden_size, int) and hidden_size != heads.hidden_size:
        raise WeightsError(
            f"{config_path}: hidden_size {hidden_size}, but the heads' ResBlocks are {heads.hidden_size} wide"
        )
    vocab_size = heads.config.get("vocab_size")
    for head, projection in enumerate(heads.projections):
        if projection is not None and isinstance(vocab_size, int) and projection.shape[0] != vocab_size:
            raise WeightsError(
                f"{config_path}: vocab_size {vocab_size}, but head {head} projects to {projection.shape[0]} tokens"
            )


def write_medusa_heads(
    directory: Path,
    weights: torch.Tensor,
    biases: torch.Tensor,
    config: dict[str, Any],
    projection: torch.Tensor | None = None,
) -> None:
    """Write heads in the published layout: ``config`` (merged over ``medusa_num_heads``,
    ``medusa_num_layers``, ``hidden_size``) as config.json, and the tensors as medusa_lm_head.safetensors.

    ``weights`` [num_heads, num_layers, hidden, hidden], ``biases`` [num_heads, num_layers, hidden]. With
    ``projection`` [vocab, hidden], every head stores it as ``"{i}.{num_layers}.weight"``; without, the
    heads use the base model's lm_head (``"version": "2"``, as FasterDecoding's train_legacy.py writes).
    """
    directory.mkdir(parents=True, exist_ok=True)
    num_heads, num_layers, hidden_size = weights.shape[0], weights.shape[1], weights.shape[2]
    tensors: dict[str, torch.Tensor] = {}
    for head in range(num_heads):
        for layer in range(num_layers):
            tensors[f"{head}.{layer}.linear.weight"] = weights[head, layer].detach().contiguous().cpu()
            tensors[f"{head}.{layer}.linear.bias"] = biases[head, layer].detach().contiguous().cpu()
        if projection is not None:
            # One tensor per key: safetensors refuses tensors that share memory.
            tensors[f"{head}.{num_layers}.weight"] = projection.detach().cpu().clone()
    full_config = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "hidden_size": hidden_size,
        **({"vocab_size": projection.shape[0]} if projection is not None else {"version": "2"}),
        **config,
    }
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(full_config, indent=2) + "\n", encoding="utf-8")


def output_projection(loaded: LoadedModel, plugins: PluginSystem, weight_format: str | None = None) -> torch.Tensor:
    """The target's output projection [vocab_size, hidden_size] as floats, as its checkpoint stores it: the
    tied embedding or ``lm_head.weight``, dequantized from a GGUF file. Taken from the loaded model when it
    holds it as floats (a tied embedding always, a dense lm_head); otherwise (a quantized, untied lm_head)
    read once from the checkpoint through its weight format (``weight_format`` as ``model.weight_format``)."""
    name = "model.embed_tokens.weight" if loaded.arch.tie_word_embeddings else "lm_head.weight"
    shape = (loaded.arch.vocab_size, loaded.arch.hidden_size)
    param = dict(loaded.model.named_parameters()).get(name)
    if param is not None and param.dtype in (torch.float32, torch.float16, torch.bfloat16) and param.shape == shape:
        return param.detach()
    reader = select_weight_format(loaded.path, plugins, weight_format)
    for item in reader.iter_tensors(loaded.path):
        if item.name == name:
            return item.tensor
    raise WeightsError(f"{loaded.path}: has no {name!r}, the model's output projection")
