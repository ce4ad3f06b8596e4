"""``tokenmill train medusa``: Medusa heads for a model, trained by self-distillation on its own answers.

``train_medusa`` follows Medusa's self-distillation recipe (Cai et al. 2024): the model answers
the bundled prompts (``prompts.txt``, written for tokenmill) through its chat template, greedily by default,
and ``num_sampled_answers`` more times each at ``sample_temperature`` for more varied text; one prefill pass
over each prompt and answer gives the hidden states and the model's own logits; head ``i`` at position ``p``
learns, by cross-entropy, the model's greedy choice for position ``p + 2 + i`` given the answer before it
(the argmax of its logits there, which is what greedy verification accepts; on a greedy answer, the answer's
own token), for every ``p`` from the prompt's last token on (the hidden state the engine hands a speculator is
the one whose logits gave the request's last token, ``p + 1``).

Only the heads' ResBlocks learn, in float32 on the CPU with torch autograd (the hidden states are computed
once, without gradients). Their linears start at zero, so an untrained head is the model's own lm_head; the
vocabulary projection is the model's output projection, frozen, and not stored
(``tokenmill_plugins.speculators.medusa_heads``): a projection of its own per head would cost the speculator a
hidden x vocab matmul per head per step, more than a quantized small model's whole step. With a draft
vocabulary (``draft_vocab_size``), the projection is cut to its rows for training and measuring too: the heads
learn to rank the tokens they will score when served, and a target outside it counts as a miss. Accuracy is
measured on the first answers of prompts held out of training (their sampled answers are not trained on
either).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill.layers.dense import onednn_enabled, onednn_linear, pack_for_onednn
from tokenmill.llm import LLM
from tokenmill.model_loader import LoadedModel
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.sampling_params import SamplingParams
from tokenmill_plugins.speculators.medusa_heads import (
    DRAFT_VOCAB,
    MEDUSA_CHOICES,
    apply_resblocks,
    output_projection,
    write_medusa_heads,
)

__all__ = ["MedusaTrainingOptions", "MedusaTrainingResult", "TrainingError", "read_prompts", "train_medusa"]

logger = logging.getLogger(__name__)

_IGNORE = -100  # target of a position whose head has no token to predict (past the end of the answer)
_OUTSIDE = -1  # target of a position whose token the draft vocabulary lacks: never drafted, so always a miss
_NO_RANK = 1 << 30  # the rank of such targets


class TrainingError(TokenmillError, ValueError):
    """Training cannot start or go on (a bad option, no prompts, nothing to learn from); one line."""


@dataclass(frozen=True)
class MedusaTrainingOptions:
    """How ``train_medusa`` trains; the ``tokenmill train medusa`` flags."""

    num_heads: int = 3
    num_layers: int = 4  # ResBlocks per head
    prompts: Path | None = None  # one prompt per line; None: the bundled prompts.txt
    max_new_tokens: int = 128  # longest answer generated per prompt
    temperature: float = 0.0  # of each prompt's first answer; 0 is greedy, which greedy verification accepts
    num_sampled_answers: int = 3  # more answers per prompt, sampled at sample_temperature (0: none)
    sample_temperature: float = 0.8
    epochs: int = 3
    batch_size: int = 128  # positions per optimizer step (each trains every head)
    lr: float = 1e-3
    held_out: float = 0.1  # share of the answers kept out of training to measure accuracy
    seed: int = 0
    tree_nodes: int = 16  # nodes of the draft tree stored as medusa_choices (0: none)
    draft_vocab_size: int = 8192  # tokens the heads score, the most frequent in the training labels (0: all)
    save_projection: bool = False  # also store the (frozen) projection in every head, Medusa-1's layout
    progress: bool = True  # tqdm progress bars on stderr

    def check(self) -> None:
        """Raise ``TrainingError`` naming the first option out of range."""
        for name, value, low in (
            ("num_heads", self.num_heads, 1),
            ("num_layers", self.num_layers, 1),
            ("max_new_tokens", self.max_new_tokens, 1),
            ("num_sampled_answers", self.num_sampled_answers, 0),
            ("epochs", self.epochs, 1),
            ("batch_size", self.batch_size, 1),
            ("tree_nodes", self.tree_nodes, 0),
            ("draft_vocab_size", self.draft_vocab_size, 0),
        ):
            if value < low:
                raise TrainingError(f"{name} must be at least {low}, got {value}")
        if not 0 < self.held_out < 1:
            raise TrainingError(f"held_out must be between 0 and 1 (a share of the answers), got {self.held_out}")
        if self.lr <= 0 or self.temperature < 0 or self.sample_temperature <= 0:
            raise TrainingError(
                f"lr and sample_temperature must be positive and temperature not negative, got {self.lr}, "
                f"{self.sample_temperature}, {self.temperature}"
            )


@dataclass(frozen=True)
class MedusaTrainingResult:
    """What ``train_medusa`` did; ``summary()`` is the command's last line."""

    output: Path
    num_answers: int  # answers generated (training and held out; num_sampled_answers + 1 per prompt)
    num_train_positions: int
    num_held_out_positions: int
    accuracies: list[float]  # per head: top-1 accuracy on the held-out answers after training
    untrained_accuracies: list[float]  # the same before training (each head is then the model's own lm_head)
    mean_accepted: float  # held out: mean drafts a chain of all heads gets accepted by greedy verification
    tree: list[tuple[int, ...]]  # the stored draft tree (medusa_choices), likeliest node first; empty: none
    tree_accepted: float  # held out: mean drafts that tree gets accepted
    draft_vocab_size: int  # tokens in the stored draft vocabulary; 0: none stored
    draft_vocab_coverage: float  # held out: the share of head 0's targets in the draft vocabulary
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        heads = ", ".join(
            f"head {i} {trained:.3f} (untrained {untrained:.3f})"
            for i, (trained, untrained) in enumerate(zip(self.accuracies, self.untrained_accuracies, strict=True))
        )
        return (
            f"{len(self.accuracies)} Medusa heads trained on {self.num_train_positions} positions in "
            f"{self.seconds:.0f} s; held-out top-1 accuracy over {self.num_held_out_positions} positions: {heads}; "
            f"{self.mean_accepted:.2f} drafts accepted per step (greedy chain)"
            + (f", {self.tree_accepted:.2f} with a tree of {len(self.tree)} nodes" if self.tree else "")
            + (
                f"; a draft vocabulary of {self.draft_vocab_size} tokens holds {self.draft_vocab_coverage:.1%} of "
                "held-out targets"
                if self.draft_vocab_size
                else ""
            )
            + f"; wrote {self.output}"
        )


def read_prompts(path: Path | None = None) -> list[str]:
    """The prompts in ``path``, one per line (blank lines skipped), or the bundled ones."""
    if path is None:
        text = resources.files("tokenmill_plugins.commands.train").joinpath("prompts.txt").read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TrainingError(f"{path}: cannot read the prompts: {' '.join(str(exc).split())}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if len(prompts) < 2:
        raise TrainingError(f"{path or 'prompts.txt'}: need at least 2 prompts (one line each), found {len(prompts)}")
    return prompts


def train_medusa(config: EngineConfig, output: Path, options: MedusaTrainingOptions) -> MedusaTrainingResult:
    """Answer the prompts with ``config``'s model, train Medusa heads on its hidden states, write them to
    ``output`` (config.json and medusa_lm_head.safetensors). Raises ``TrainingError`` for bad options and
    the loader's errors (``ModelNotFoundError``, ...) for a bad model, each one line."""
    options.check()
    started = time.monotonic()
    prompts = read_prompts(options.prompts)
    llm = LLM.from_config(config)
    loaded = llm.engine.loaded
    sequences = _answer(llm, prompts, options)
    hidden, targets, answer_of_row = _hidden_states(loaded, sequences, options.num_heads, options.progress)
    vocab_projection = output_projection(loaded, llm.engine.plugins, config.model.weight_format).float().cpu()
    weight = vocab_projection
    train_rows, held_out_rows = _split(answer_of_row, len(prompts), options)
    draft_vocab: list[int] = []
    coverage = 1.0
    if options.draft_vocab_size:
        draft_vocab, coverage = _draft_vocab(targets[train_rows], targets[held_out_rows, 0], options.draft_vocab_size)
        # The heads learn and are measured as they will serve: scoring the draft vocabulary's tokens only.
        targets = _in_draft_vocab(targets, draft_vocab, len(vocab_projection))
        weight = vocab_projection[draft_vocab]
    projection = _Projection(weight)
    torch.manual_seed(options.seed)
    heads = _Heads(options.num_heads, options.num_layers, loaded.arch.hidden_size)
    untrained = _evaluate(heads, projection, hidden[held_out_rows], targets[held_out_rows])[0]
    _fit(heads, projection, hidden[train_rows], targets[train_rows], options)
    accuracies, mean_accepted = _evaluate(heads, projection, hidden[held_out_rows], targets[held_out_rows])
    tree: list[tuple[int, ...]] = []
    tree_accepted = 0.0
    if options.tree_nodes:
        ranks = _ranks(heads, projection, hidden[held_out_rows], targets[held_out_rows])
        tree, tree_accepted = _best_tree(ranks, options.tree_nodes)
    settings = {
        "prompts": str(options.prompts) if options.prompts else "bundled prompts.txt",
        "num_answers": len(sequences),
        "max_new_tokens": options.max_new_tokens,
        "temperature": options.temperature,
        "num_sampled_answers": options.num_sampled_answers,
        "sample_temperature": options.sample_temperature,
        "num_layers": options.num_layers,
        "epochs": options.epochs,
        "batch_size": options.batch_size,
        "lr": options.lr,
        "seed": options.seed,
        "held_out_top1_accuracy": [round(a, 4) for a in accuracies],
        "held_out_mean_accepted": round(mean_accepted, 4),
        "held_out_tree_accepted": round(tree_accepted, 4),
        "draft_vocab_size": len(draft_vocab),
        "held_out_draft_vocab_coverage": round(coverage, 4),
    }
    write_medusa_heads(
        output,
        heads.weight.detach(),
        heads.bias.detach(),
        {
            "base_model_name_or_path": config.model.model,
            "vocab_size": loaded.arch.vocab_size,
            "tokenmill_training": settings,
            **({MEDUSA_CHOICES: [list(node) for node in tree]} if tree else {}),
            **({DRAFT_VOCAB: draft_vocab} if draft_vocab else {}),
        },
        vocab_projection if options.save_projection else None,
    )
    return MedusaTrainingResult(
        output=output,
        num_answers=len(sequences),
        num_train_positions=len(train_rows),
        num_held_out_positions=len(held_out_rows),
        accuracies=accuracies,
        untrained_accuracies=untrained,
        mean_accepted=mean_accepted,
        tree=tree,
        tree_accepted=tree_accepted,
        draft_vocab_size=len(draft_vocab),
        draft_vocab_coverage=coverage,
        seconds=time.monotonic() - started,
        settings=settings,
    )


def _answer(llm: LLM, prompts: list[str], options: MedusaTrainingOptions) -> list[tuple[list[int], int]]:
    """Each prompt, through the chat template, and the model's answers: (token ids, number of prompt tokens).
    The first ``len(prompts)`` are the answers at ``temperature``; then ``num_sampled_answers`` rounds of one
    sampled answer per prompt, so answer ``j`` answers prompt ``j % len(prompts)``."""
    first = SamplingParams(
        temperature=options.temperature,
        max_tokens=options.max_new_tokens,
        seed=options.seed if options.temperature > 0 else None,
    )
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    outputs = llm.chat(conversations, first, use_tqdm=options.progress)
    answers = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]
    if options.num_sampled_answers:
        # n > 1: one prefill per prompt, each sample a sequence of its own (with its own seeded stream).
        sampled = SamplingParams(
            n=options.num_sampled_answers,
            temperature=options.sample_temperature,
            max_tokens=options.max_new_tokens,
            seed=options.seed + 1,
        )
        samples = llm.chat(conversations, sampled, use_tqdm=options.progress)
        for round_ in range(options.num_sampled_answers):
            answers += [(list(o.prompt_token_ids), list(o.outputs[round_].token_ids)) for o in samples]
    return [(prompt + answer, len(prompt)) for prompt, answer in answers]


@torch.inference_mode()
def _hidden_states(
    loaded: LoadedModel, sequences: Sequence[tuple[list[int], int]], num_heads: int, progress: bool,
    block_size: int = 16, max_batch_tokens: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One prefill pass per batch of sequences on a KV cache of its own. Returns, for every position from
    each prompt's last token to the third-last token: its hidden state [num_rows, hidden] float32, the
    tokens the heads should predict there [num_rows, num_heads] (the model's greedy choices, from its logits in
    the same pass; ``_IGNORE`` past the end), and the index of its sequence [num_rows]."""
    batches: list[list[int]] = [[]]
    batch_tokens = 0
    for index, (token_ids, _) in enumerate(sequences):
        if batches[-1] and batch_tokens + len(token_ids) > max_batch_tokens:
            batches.append([])
            batch_tokens = 0
        batches[-1].append(index)
        batch_tokens += len(token_ids)
    num_blocks = max(sum(math.ceil(len(sequences[i][0]) / block_size) for i in batch) for batch in batches)
    runner = ModelRunner(loaded, num_blocks, block_size)
    hidden_rows, target_rows, sequence_rows = [], [], []
    for batch in tqdm(batches, desc="hidden states", unit="batch", disable=not progress):
        chunks, next_block = [], 0
        for index in batch:
            token_ids = sequences[index][0]
            num_seq_blocks = math.ceil(len(token_ids) / block_size)
            chunks.append(SequenceChunk(token_ids, 0, list(range(next_block, next_block + num_seq_blocks))))
            next_block += num_seq_blocks
        input_ids, metadata = runner.prepare_batch(chunks)
        hidden = loaded.model(input_ids, metadata.positions, runner.kv_caches, metadata)  # [num_tokens, hidden]
        start = 0
        for index, chunk in zip(batch, chunks, strict=True):
            token_ids, num_prompt_tokens = sequences[index]
            positions = range(num_prompt_tokens - 1, len(token_ids) - 2)  # head 0 has a token to predict
            if len(positions) > 0:
                hidden_rows.append(hidden[start + positions.start : start + positions.stop].float().cpu())
                # The model's choice for each answer position, given the answer before it.
                logits = loaded.model.compute_logits(hidden[start + num_prompt_tokens - 1 : start + len(token_ids) - 1])
                greedy = token_ids[:num_prompt_tokens] + logits.argmax(dim=-1).tolist()  # [seq_len]
                padded = torch.tensor(greedy + [_IGNORE] * num_heads)  # [seq_len + num_heads]
                offsets = torch.arange(positions.start, positions.stop).unsqueeze(1) + 2 + torch.arange(num_heads)
                target_rows.append(padded[offsets])  # [len(positions), num_heads]
                sequence_rows.append(torch.full((len(positions),), index))
            start += len(chunk.token_ids)
    if not hidden_rows:
        raise TrainingError("the model's answers are all shorter than 3 tokens: nothing to train the heads on")
    # Clones outside inference mode: autograd may save tensors made from them.
    with torch.inference_mode(False):
        return torch.cat(hidden_rows).clone(), torch.cat(target_rows).clone(), torch.cat(sequence_rows).clone()


def _split(
    sequence_of_row: torch.Tensor, num_prompts: int, options: MedusaTrainingOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to train on (every answer to a training prompt) and rows to measure on (the first answer to each
    held-out prompt: how the model answers at ``temperature``); the held-out prompts are chosen with the seed."""
    order = list(range(num_prompts))
    random.Random(options.seed).shuffle(order)
    num_held_out = min(max(1, round(options.held_out * num_prompts)), num_prompts - 1)
    held_out = torch.zeros(num_prompts, dtype=torch.bool)
    held_out[order[:num_held_out]] = True
    is_held_out = held_out[sequence_of_row % num_prompts]  # [num_rows]: answer j answers prompt j % num_prompts
    is_first = sequence_of_row < num_prompts
    train_rows = torch.nonzero(~is_held_out).squeeze(1)
    held_out_rows = torch.nonzero(is_held_out & is_first).squeeze(1)
    if len(train_rows) == 0 or len(held_out_rows) == 0:
        raise TrainingError("too few answers to hold some out for measuring accuracy; give more prompts")
    return train_rows, held_out_rows


class _Projection:
    """``x @ weight.T`` for the frozen vocabulary projection ``weight`` [vocab, hidden], with the gradient for ``x``:
    through oneDNN on ``weight`` and its transpose packed for it where available (``tokenmill.layers.dense``'s
    ``onednn`` matmul: ``@`` takes MKL's slow generic path on AMD CPUs, and at the hundreds of rows of a training
    batch oneDNN is as fast as the layer kernels' dense matmul), else with torch's ``@``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        #: For x [.., hidden] -> [.., vocab], and the transpose for the gradient.
        self._packed = (pack_for_onednn(weight), pack_for_onednn(weight.T.contiguous())) if onednn_enabled() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return x @ self.weight.T
        return _ProjectionMatmul.apply(x, *self._packed)


class _ProjectionMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, packed_transpose: torch.Tensor) -> torch.Tensor:
        ctx.packed_transpose = packed_transpose
        return onednn_linear(x, packed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return onednn_linear(grad.contiguous(), ctx.packed_transpose), None, None


class _Heads(nn.Module):
    """The trainable part of the heads: every head's ResBlocks, zero-initialised (Medusa zeroes the weight; the
    bias too here, so that an untrained head is exactly the model's lm_head)."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return apply_resblocks(hidden, self.weight, self.bias)


def _fit(
    heads: _Heads, projection: _Projection, hidden: torch.Tensor, targets: torch.Tensor,
    options: MedusaTrainingOptions,
) -> None:  # fmt: skip
    """AdamW on the summed per-head cross-entropy (Medusa's loss), cosine-decayed learning rate."""
    targets = targets.masked_fill(targets < 0, _IGNORE)  # a token outside the draft vocabulary: nothing to learn
    generator = torch.Generator().manual_seed(options.seed)
    num_steps = options.epochs * math.ceil(len(hidden) / options.batch_size)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=options.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, num_steps)
    with tqdm(total=num_steps, desc="training heads", unit="step", disable=not options.progress) as bar:
        for _ in range(options.epochs):
            for rows in torch.randperm(len(hidden), generator=generator).split(options.batch_size):
                logits = projection(heads(hidden[rows]))  # [num_heads, batch, vocab]
                losses = [
                    F.cross_entropy(logits[head], targets[rows, head], ignore_index=_IGNORE)
                    for head in range(logits.shape[0])
                    if bool((targets[rows, head] != _IGNORE).any())
                ]
                loss = torch.stack(losses).sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")


@torch.no_grad()
def _ranks(
    heads: _Heads, projection: _Projection, hidden: torch.Tensor, targets: torch.Tensor, batch_size: int = 512
) -> torch.Tensor:
    """[num_rows, num_heads]: the rank of each head's target among its logits (0: its top-1); a large number
    where the head has no target."""
    ranks = []
    for rows in torch.arange(len(hidden)).split(batch_size):
        logits = projection(heads(hidden[rows]))  # [num_heads, batch, vocab]
        target = targets[rows].T  # [num_heads, batch]
        chosen = logits.gather(-1, target.clamp(min=0).unsqueeze(-1))  # [num_heads, batch, 1]
        rank = (logits > chosen).sum(-1)  # [num_heads, batch]
        ranks.append(torch.where(target < 0, _NO_RANK, rank).T)
    return torch.cat(ranks)


def _best_tree(ranks: torch.Tensor, num_nodes: int, max_rank: int = 10) -> tuple[list[tuple[int, ...]], float]:
    """The draft tree of at most ``num_nodes`` nodes that greedy verification would accept most of on these
    rows (``ranks`` as ``_ranks`` gives them): every rank path a row's targets take, from the root, counted
    over the rows, and the most frequent kept, likeliest first. A prefix is at least as frequent as its
    extensions, so parents come first (on ties, the shorter path wins). Also returns the mean drafts such a
    tree gets accepted per step on these rows."""
    counts: dict[tuple[int, ...], int] = {}
    for row in ranks.tolist():
        node: tuple[int, ...] = ()
        for rank in row:
            if rank >= max_rank:
                break
            node = (*node, rank)
            counts[node] = counts.get(node, 0) + 1
    best = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))[:num_nodes]
    return [node for node, _ in best], sum(count for _, count in best) / max(1, len(ranks))


def _in_draft_vocab(targets: torch.Tensor, draft_vocab: list[int], vocab_size: int) -> torch.Tensor:
    """``targets`` as positions in ``draft_vocab`` (the rows of the projection the heads score): ``_OUTSIDE`` for
    a token it lacks, ``_IGNORE`` kept. Cross-entropy skips both; accuracy counts ``_OUTSIDE`` as a miss."""
    position = torch.full((vocab_size + 1,), _OUTSIDE, dtype=torch.long)  # the last entry: _IGNORE's
    position[torch.tensor(draft_vocab, dtype=torch.long)] = torch.arange(len(draft_vocab))
    position[vocab_size] = _IGNORE
    return position[torch.where(targets == _IGNORE, vocab_size, targets)]


def _draft_vocab(train_targets: torch.Tensor, held_out_targets: torch.Tensor, size: int) -> tuple[list[int], float]:
    """The ``size`` tokens the heads were trained to predict most often (fewer if fewer occur), most frequent
    first, and the share of ``held_out_targets`` among them."""
    labels = train_targets[train_targets != _IGNORE]
    counts = torch.bincount(labels, minlength=int(labels.max()) + 1 if len(labels) else 1)
    order = counts.argsort(descending=True, stable=True)[: min(size, int((counts > 0).sum()))]
    held_out = held_out_targets[held_out_targets != _IGNORE]
    coverage = float(torch.isin(held_out, order).float().mean()) if len(held_out) else 1.0
    return order.tolist(), coverage


@torch.no_grad()
def _evaluate(
    heads: _Heads, projection: _Projection, hidden: torch.Tensor, targets: torch.Tensor, batch_size: int = 512
) -> tuple[list[float], float]:
    """Per-head top-1 accuracy over the rows where the head has a target, and the mean length of the
    correct prefix of the heads' chain (the drafts greedy verification keeps) over the rows where all
    heads have one."""
    correct = _ranks(heads, projection, hidden, targets, batch_size) == 0  # [num_rows, num_heads]
    valid = targets != _IGNORE
    accuracies = [
        float(correct[valid[:, head], head].float().mean()) if bool(valid[:, head].any()) else 0.0
        for head in range(targets.shape[1])
    ]
    complete = valid.all(dim=1)
    accepted = correct[complete].int().cumprod(dim=1).sum(dim=1).float()  # [num_complete_rows]
    return accuracies, float(accepted.mean()) if len(accepted) else 0.0
