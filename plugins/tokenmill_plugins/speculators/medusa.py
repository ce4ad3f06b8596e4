"""The ``medusa`` speculator: Medusa heads on the target's last hidden state draft a chain of tokens.

Each head ``i`` reads the target's final hidden state at the position whose logits gave the request's
last token and predicts the token ``i + 1`` positions after it (``medusa_heads`` beside this module has
the heads' math and their checkpoint format, FasterDecoding's). Drafts are deterministic (no ``draft_probs``),
which is exact for sampled requests too. They come in one of two shapes:

- a **tree** (Medusa's tree attention, ``tokenmill.speculative.draft_tree``): several candidates per head, verified
  together. Its shape is ``speculative_config.speculative_token_tree`` (vLLM's key: each node the path of
  candidate ranks, ``(1, 0)`` being head 1's top-1 after head 0's second candidate) or, when unset, the
  ``medusa_choices`` stored in the heads' ``config.json`` (``tokenmill train medusa`` writes the nodes that
  were accepted most often on its held-out answers, likeliest first); ``k`` counts nodes, and a request
  gets the first ``min(k, max_num_tokens)`` of them. Node ``(r_0, ..., r_d)``'s token is head ``d``'s
  candidate of rank ``r_d``: heads read only the hidden state, so a head's candidates are the same under
  every parent.
- a **chain**, without a tree or with an attention backend that cannot verify trees: every head's top-1
  token, ``[argmax head_0(h), ..., argmax head_{n-1}(h)]`` with ``n = min(k, max_num_tokens)``.

Configured with ``--speculative-config '{"method": "medusa", "model": "DIR"}'``; ``num_speculative_tokens``
may be at most the number of heads in DIR and is the number of heads when unset. ``tokenmill train medusa``
trains heads for a model.

Cost. All heads of all requests run together: one batched matmul per ResBlock layer ([num_heads, rows,
hidden] x [num_heads, hidden, hidden]), then the vocabulary projections. A projection is hidden x vocab:
for SmolLM2-135M 576 x 49152 = 28M weights, 113 MB in float32, read once per head per step, where the
Q4_1 model's whole decode step reads about 97 MB (66 MB of 4-bit layers, 30 MB of 8-bit lm_head). So a
head whose projection *is* the target's output projection (every head of FasterDecoding's
train_legacy.py and of ``tokenmill train medusa``, which store none; a Medusa-1 head whose stored weights
equal it) is computed by the target's own ``compute_logits``: all such heads of all requests in one call
on [num_heads * rows, hidden], through the quantized lm_head's kernel on a quantized target.

A stored projection counts as the target's when its values equal the target checkpoint's output projection
(the tied embedding or lm_head, dequantized from GGUF; ``medusa_heads.output_projection``) once both are
rounded to the coarser of their two dtypes; this is checked once, at construction. Such heads then use the
target's lm_head as it runs, quantized or not: the same approximation as the target's own logits, which verify
the drafts anyway. Other heads multiply by their own weights, kept on the target's device in its dtype.

A draft vocabulary (``draft_vocab`` in config.json, which ``tokenmill train medusa`` writes; after FR-Spec, Zhao
et al. 2025) cuts that cost further: the heads score only its tokens, the ones they learnt to predict most often,
through those rows of the projection (from the checkpoint, as floats, for shared heads), so a step reads at most
8,192 of SmolLM2's 49,152 rows (5,795 for the default model's trained heads); a token outside it is never drafted,
which verification makes a missed guess, never a wrong token.

The heads' ResBlocks, and the draft vocabulary's rows of the target's projection, are quantized by
``speculative_config.quantization``: unset, int8 for a float32 target on a CPU (a projection of a head's own
stays in the target's dtype). The target's pass evicts them
from the caches, so each ``propose`` reads them from memory, and int8 reads a quarter of float32's bytes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from tokenmill.config import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantizer import Quantizer
from tokenmill.model_loader import LoadedModel, select_quantizer
from tokenmill.plugin_manager import PluginError, Slot
from tokenmill.sampling.sampler import row_argmax
from tokenmill.speculative.draft_tree import TokenTree, parse_token_tree, tree_parents
from tokenmill.speculative.speculator import Proposal, SpeculationInput, Speculator, SpeculatorContext
from tokenmill.weights.format import WeightsError
from tokenmill_plugins.speculators.medusa_heads import (
    DRAFT_VOCAB,
    MEDUSA_CHOICES,
    apply_resblocks,
    output_projection,
    read_medusa_config,
    read_medusa_heads,
)

__all__ = ["MedusaSpeculator"]

logger = logging.getLogger(__name__)


class MedusaSpeculator(Speculator):
    """Drafts up to ``k`` tokens per request with Medusa heads on the target's hidden states (a chain).

    Built once per engine process with the engine's ``SpeculatorContext`` (it cannot run without one: the
    heads read the target's hidden states and may share its lm_head). ``num_speculative_tokens`` becomes
    the number of heads when ``speculative_config.num_speculative_tokens`` is unset. Raises
    ``ConfigError`` for a missing heads directory or a ``k`` above the number of heads, and
    ``WeightsError`` for a checkpoint that is unreadable or sized for another model. A request given no
    hidden state gets no drafts.
    """

    name: ClassVar[str] = "medusa"
    needs_hidden_states: ClassVar[bool] = True
    supports_draft_trees: ClassVar[bool] = True
    #: Whether heads whose stored projection equals the target's output projection use the target's
    #: ``compute_logits`` (see the module docstring); False keeps every head on its own weights.
    share_output_projection: ClassVar[bool] = True

    def __init__(self, num_speculative_tokens: int, context: SpeculatorContext | None = None) -> None:
        super().__init__(num_speculative_tokens, context)
        if context is None:
            raise ConfigError("the 'medusa' speculator runs inside an engine only: its heads read the target's "
                              "hidden states")  # fmt: skip
        spec = context.config.speculative_config
        if not spec.model:
            raise ConfigError("speculative_config.model is unset: give the directory of the Medusa heads")
        directory = Path(spec.model)
        if not directory.exists():
            raise ConfigError(f"speculative_config.model: {directory} does not exist; give the directory of the "
                              "Medusa heads (config.json and medusa_lm_head.safetensors)")  # fmt: skip
        is_set = spec.num_speculative_tokens is not None
        #: The tree's nodes as rank paths, or None to draft chains.
        self.tree = self._tree(directory, spec.speculative_token_tree, context.verifies_draft_trees)
        if self.tree is not None:
            if is_set and num_speculative_tokens > len(self.tree):
                raise ConfigError(f"speculative_config.num_speculative_tokens={num_speculative_tokens}, but the draft "
                                  f"tree of {directory} has {len(self.tree)} nodes: set it to at most "
                                  f"{len(self.tree)}, or leave it unset")  # fmt: skip
            self.tree = self.tree[:num_speculative_tokens] if is_set else self.tree
            self.num_speculative_tokens = len(self.tree)
            depth = max(map(len, self.tree))
            heads = read_medusa_heads(directory, num_heads=depth)
            if depth > heads.num_heads:
                raise ConfigError(f"the draft tree is {depth} levels deep, but {directory} holds {heads.num_heads} "
                                  "Medusa heads: one per level")  # fmt: skip
            self._parents = tree_parents(self.tree)
            #: Candidates each head needs: one more than the largest rank at its depth.
            self._num_candidates = [
                1 + max(node[-1] for node in self.tree if len(node) == depth + 1) for depth in range(heads.num_heads)
            ]
        else:
            heads = read_medusa_heads(directory, num_heads=num_speculative_tokens if is_set else None)
            if not is_set:
                self.num_speculative_tokens = heads.num_stored_heads
            elif num_speculative_tokens > heads.num_stored_heads:
                raise ConfigError(f"speculative_config.num_speculative_tokens={num_speculative_tokens}, but "
                                  f"{directory} holds {heads.num_stored_heads} Medusa heads: set it to at most "
                                  f"{heads.num_stored_heads}, or leave it unset")  # fmt: skip
        target = self._target = context.target
        _check_sizes(directory, heads.hidden_size, heads.config.get("vocab_size"), heads.projections, target)
        quantizer = _heads_quantizer(spec.quantization, context)
        #: Every head's ResBlocks: float weights in batched matmuls, or the quantizer's layers.
        self._resblocks: _FloatResBlocks | _QuantizedResBlocks = (
            _FloatResBlocks(heads.weights, heads.biases, target) if quantizer.is_dense
            else _QuantizedResBlocks(heads.weights, heads.biases, quantizer, target)
        )  # fmt: skip
        #: The heads computed by the target's ``compute_logits`` (the others use their own projection).
        self.shared_heads = shared = self._shared_heads(heads.projections, context)
        own = [(head, projection) for head, projection in enumerate(heads.projections) if head not in shared]
        #: By the number of heads a step runs, n: the indices of its shared heads, and of its own-projection heads.
        self._shared_index = [_index([h for h in shared if h < n], target.device) for n in range(heads.num_heads + 1)]
        self._own_index = [_index([h for h, _ in own if h < n], target.device) for n in range(heads.num_heads + 1)]
        self._projections: torch.Tensor | None = None  # [num_own_heads, vocab, hidden], in head order
        if own:
            self._projections = torch.stack([p.to(target.device, target.dtype) for _, p in own if p is not None])
        #: With a draft vocabulary (``draft_vocab`` in config.json): its token ids [draft_vocab_size], and the
        #: shared heads' projection cut to those rows, as a dense layer (oneDNN on a CPU, as the model's own).
        self._draft_vocab = _draft_vocab(directory, heads.config, target.arch.vocab_size, target.device)
        self._draft_projection: Linear | None = None
        if self._draft_vocab is not None:
            if shared:
                reference = output_projection(target, context.plugins, context.config.model.weight_format)
                rows = reference[self._draft_vocab.to(reference.device)]  # [draft_vocab_size, hidden]
                self._draft_projection = _linear(rows, None, quantizer, target)
            if self._projections is not None:
                self._projections = self._projections[:, self._draft_vocab].contiguous()
        logger.info(
            "medusa: %d heads (%d ResBlocks each, %s) from %s, %d of them on the target's lm_head, scoring %s; "
            "drafting %s",
            heads.num_heads, heads.num_layers, quantizer.name, directory, len(shared),
            f"a draft vocabulary of {len(self._draft_vocab)} tokens" if self._draft_vocab is not None else
            "the whole vocabulary",
            f"a tree of {len(self.tree)} nodes" if self.tree is not None else "a chain",
        )  # fmt: skip

    @staticmethod
    def _tree(directory: Path, configured: str | None, verifies_trees: bool) -> TokenTree | None:
        """The draft tree: the configured one, else the heads' stored ``medusa_choices`` if the engine verifies
        trees (the engine refuses a configured tree it cannot verify). Raises ``WeightsError`` for a stored
        tree that does not parse or that needs more heads than stored."""
        if configured is not None:
            return parse_token_tree(configured)
        stored = read_medusa_config(directory).get(MEDUSA_CHOICES)
        if stored is None:
            return None
        try:
            tree = parse_token_tree(stored)
        except ValueError as exc:
            raise WeightsError(f"{directory}/config.json: {MEDUSA_CHOICES}: {exc}") from None
        if not verifies_trees:
            logger.info("medusa: the attention backend cannot verify draft trees; drafting chains, not the heads' "
                        "tree of %d nodes", len(tree))  # fmt: skip
            return None
        return tree

    def _shared_heads(self, projections: list[torch.Tensor | None], context: SpeculatorContext) -> list[int]:
        """The heads whose logits come from the target's ``compute_logits``: those with no projection of their
        own, and, with ``share_output_projection``, those whose projection equals the target's."""
        stored = [(head, projection) for head, projection in enumerate(projections) if projection is not None]
        shared = [head for head, projection in enumerate(projections) if projection is None]
        if stored and self.share_output_projection:
            reference = output_projection(context.target, context.plugins, context.config.model.weight_format)
            shared += [head for head, projection in stored if _same_values(projection, reference)]
        return sorted(shared)

    @torch.inference_mode()
    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        """One pass of the heads needed over every request's hidden state: the tree's nodes, or each head's
        top-1 token."""
        if self.tree is not None:
            return self._propose_tree(requests)
        token_ids: list[list[int]] = [[] for _ in requests]
        rows: list[tuple[int, int]] = []  # (request index, number of drafts)
        states: list[torch.Tensor] = []
        for index, item in enumerate(requests):
            num_drafts = min(self.num_speculative_tokens, item.max_num_tokens)
            if num_drafts > 0 and item.hidden_state is not None:
                rows.append((index, num_drafts))
                states.append(item.hidden_state)
        if not rows:
            return Proposal(token_ids)
        hidden = torch.stack(states).to(self._target.device, self._target.dtype)  # [num_rows, hidden]
        drafts = self._draft(hidden, max(num_drafts for _, num_drafts in rows)).tolist()
        for row, (index, num_drafts) in enumerate(rows):
            token_ids[index] = drafts[row][:num_drafts]
        return Proposal(token_ids)

    def _propose_tree(self, requests: list[SpeculationInput]) -> Proposal:
        """Each request's first ``min(k, max_num_tokens)`` tree nodes, from the heads' candidates."""
        token_ids: list[list[int]] = [[] for _ in requests]
        parents: list[list[int] | None] = [None] * len(requests)
        rows = [i for i, item in enumerate(requests) if item.max_num_tokens > 0 and item.hidden_state is not None]
        if not rows:
            return Proposal(token_ids, parents=parents)
        states = [requests[i].hidden_state for i in rows]
        hidden = torch.stack(states).to(self._target.device, self._target.dtype)  # type: ignore[arg-type]
        candidates = self._candidates(hidden)  # per head: [num_rows, num_candidates] as lists
        for row, index in enumerate(rows):
            num_nodes = min(self.num_speculative_tokens, requests[index].max_num_tokens)
            token_ids[index] = [candidates[len(node) - 1][row][node[-1]] for node in self.tree[:num_nodes]]  # type: ignore[index]
            parents[index] = self._parents[:num_nodes]
        return Proposal(token_ids, parents=parents)

    def _logits(self, hidden: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
        """The first ``num_heads`` heads' logits for ``hidden`` [num_rows, hidden], as [num_heads] tensors
        [num_rows, vocab] (with a draft vocabulary: [num_rows, draft_vocab_size], over its tokens): the heads on
        the target's lm_head in one call, the others by their own projection."""
        num_rows = hidden.shape[0]
        x = self._resblocks(hidden, num_heads)  # [num_heads, rows, hidden]
        logits: list[torch.Tensor | None] = [None] * num_heads
        shared = self._shared_index[num_heads]
        if len(shared):
            rows = x[shared].reshape(len(shared) * num_rows, -1)  # [num_shared * num_rows, hidden]
            if self._draft_projection is not None:
                shared_logits = self._draft_projection(rows)
            else:
                shared_logits = self._target.model.compute_logits(rows)
            for position, head in enumerate(shared.tolist()):
                logits[head] = shared_logits[position * num_rows : (position + 1) * num_rows]
        own = self._own_index[num_heads]
        if len(own):
            assert self._projections is not None
            projections = self._projections[: len(own)]  # own heads are in order: the first len(own) are < num_heads
            own_logits = torch.bmm(x[own], projections.transpose(1, 2))  # [len(own), num_rows, vocab]
            for position, head in enumerate(own.tolist()):
                logits[head] = own_logits[position]
        return logits  # type: ignore[return-value]

    def _candidates(self, hidden: torch.Tensor) -> list[list[list[int]]]:
        """Per head the tree needs, each row's top candidates, best first: [num_heads][num_rows][num_candidates]."""
        logits = self._logits(hidden, len(self._num_candidates))
        counts = self._num_candidates
        return [self._tokens(head.topk(n, dim=-1).indices).tolist() for head, n in zip(logits, counts, strict=True)]

    def _draft(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """The first ``num_heads`` heads' top-1 tokens for ``hidden`` [num_rows, hidden]: [num_rows, num_heads]."""
        best = torch.stack([row_argmax(head) for head in self._logits(hidden, num_heads)], dim=1)
        return self._tokens(best).cpu()

    def _tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of indices into the heads' logits (the draft vocabulary's positions, when there is one)."""
        return self._draft_vocab[indices] if self._draft_vocab is not None else indices


def _heads_quantizer(name: str | None, context: SpeculatorContext) -> Quantizer:
    """The quantizer of the heads' own weights (ResBlocks, draft vocabulary rows): ``speculative_config.quantization``,
    or when unset int8 where it runs (a float32 target on a CPU), else none. The heads only propose, so an
    approximation costs at most a missed guess; int8 reads a quarter of float32's bytes, and the heads' weights
    are read from memory every step (the target's pass has evicted them from the caches)."""
    target = context.target
    hidden_size = target.arch.hidden_size
    if name is None:
        name = "none"
        if target.dtype == torch.float32 and "int8" in context.plugins.registry.names(Slot.QUANTIZER):
            int8 = context.plugins.registry.load(Slot.QUANTIZER, "int8")
            fits = hidden_size % getattr(int8, "input_group_size", 1) == 0
            name = "int8" if fits and target.device.type in int8.supported_devices and int8.is_available() else "none"
    try:
        quantizer = select_quantizer(name, target.arch, target.device, context.plugins)
    except PluginError as exc:  # an unknown name, one that cannot run here, a checkpoint format's reader
        raise ConfigError(f"speculative_config.quantization: {exc}") from None
    group = getattr(quantizer, "input_group_size", 1)
    if hidden_size % group:
        raise ConfigError(f"speculative_config.quantization={name!r} quantizes groups of {group} inputs, and the heads "
                          f"are {hidden_size} wide; use 'none'")  # fmt: skip
    return quantizer


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, quantizer: Quantizer, target: LoadedModel) -> Linear:
    """A ``Linear`` on the target's device and dtype holding ``weight`` [out, in] (and ``bias``), by ``quantizer``."""
    layer = Linear(weight.shape[1], weight.shape[0], bias is not None, quantizer, target.dtype).to(target.device)
    layer.load_weight("weight", weight.to(target.device, target.dtype))
    if bias is not None:
        layer.load_weight("bias", bias.to(target.device, target.dtype))
    return layer


class _FloatResBlocks:
    """Every head's ResBlocks in the target's dtype, all heads in one batched matmul per layer (``apply_resblocks``)."""

    def __init__(self, weights: torch.Tensor, biases: torch.Tensor, target: LoadedModel) -> None:
        self.weights = weights.to(target.device, target.dtype)  # [num_heads, num_layers, hidden, hidden]
        self.biases = biases.to(target.device, target.dtype)  # [num_heads, num_layers, hidden]

    def __call__(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """The first ``num_heads`` heads' ResBlocks over ``hidden`` [rows, hidden]: [num_heads, rows, hidden]."""
        return apply_resblocks(hidden, self.weights[:num_heads], self.biases[:num_heads])


class _QuantizedResBlocks:
    """Every head's ResBlocks as quantized layers. The first layer reads the same hidden state in every head, so
    the heads' first linears run as one layer of ``num_heads * hidden`` outputs (head-major: a step running fewer
    heads keeps the first ones' columns); later layers, one per head."""

    def __init__(self, weights: torch.Tensor, biases: torch.Tensor, quantizer: Quantizer, target: LoadedModel) -> None:
        num_heads, num_layers, hidden, _ = weights.shape
        #: Every head's first layer; None for heads without ResBlocks.
        self._first = (
            _linear(weights[:, 0].reshape(num_heads * hidden, hidden), biases[:, 0].reshape(num_heads * hidden),
                    quantizer, target) if num_layers else None
        )  # fmt: skip
        self._later = [[_linear(weights[h, layer], biases[h, layer], quantizer, target)
                        for layer in range(1, num_layers)] for h in range(num_heads)]  # fmt: skip

    def __call__(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``apply_resblocks`` for the first ``num_heads`` heads: [num_heads, num_rows, hidden]."""
        if self._first is None:
            return hidden.unsqueeze(0).expand(num_heads, -1, -1)
        first = F.silu(self._first(hidden)[:, : num_heads * hidden.shape[1]])  # [rows, num_heads * hidden]
        x = hidden.unsqueeze(0) + first.view(hidden.shape[0], num_heads, -1).transpose(0, 1)  # [heads, rows, hidden]
        outputs = []
        for head in range(num_heads):
            h = x[head]
            for layer in self._later[head]:
                h = h + F.silu(layer(h))
            outputs.append(h)
        return torch.stack(outputs)


def _check_sizes(
    directory: Path, hidden_size: int, vocab_size: object, projections: list[torch.Tensor | None], target: LoadedModel
) -> None:
    """Raise ``WeightsError`` unless the heads' widths and vocabulary are the target's."""
    arch = target.arch
    if hidden_size != arch.hidden_size:
        raise WeightsError(f"{directory}: the Medusa heads are {hidden_size} wide, the target model's hidden size is "
                           f"{arch.hidden_size}: they were trained for another model")  # fmt: skip
    sizes = {vocab_size} if isinstance(vocab_size, int) else set()
    sizes |= {projection.shape[0] for projection in projections if projection is not None}
    other = sorted(size for size in sizes if size != arch.vocab_size)
    if other:
        raise WeightsError(f"{directory}: the Medusa heads predict a vocabulary of {other[0]} tokens, the target "
                           f"model's has {arch.vocab_size}: they were trained for another model")  # fmt: skip


def _draft_vocab(
    directory: Path, config: dict[str, object], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """config.json's ``draft_vocab`` as token ids on ``device``, or None; ``WeightsError`` when it is not a list of
    distinct token ids of the target's vocabulary."""
    tokens = config.get(DRAFT_VOCAB)
    if tokens is None:
        return None
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens)
        or len(set(tokens)) != len(tokens)
    ):
        raise WeightsError(f"{directory}/config.json: {DRAFT_VOCAB} must list distinct token ids below {vocab_size}")
    return torch.tensor(tokens, dtype=torch.long, device=device)


def _index(heads: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(heads, dtype=torch.long, device=device)  # [len(heads)]


def _same_values(stored: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether two float tensors hold the same values once both are rounded to the coarser dtype (a bfloat16
    copy of float32 weights equals them; any other difference does not)."""
    if stored.shape != reference.shape:
        return False
    coarser = max(stored.dtype, reference.dtype, key=lambda dtype: torch.finfo(dtype).eps)
    return torch.equal(stored.to(reference.device, coarser), reference.to(coarser))
