"""The conformance checks of ``tokenmill.testing``, through the public module.

Every first-party implementation of every slot, found in the registry as a plugin author's would be,
passes its slot's check; and for each check, a planted wrong implementation fails it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.interfaces import (
    AttentionLayerSpec,
    EngineState,
    LogitsProcessor,
    Proposal,
    SamplingRow,
    SpeculationInput,
    Speculator,
)
from tokenmill.kv_cache.manager import PagedKVCacheManager, PrefixMatch, SlotAllocation
from tokenmill.messages import EngineCoreRequest
from tokenmill.plugin_manager import FIRST_PARTY_DISTRIBUTION, Slot, load_plugins
from tokenmill.testing import (
    DictKVTier,
    check_attention_backend,
    check_fused_experts,
    check_kv_cache_manager,
    check_kv_tier,
    check_layer_kernels,
    check_logits_processor,
    check_lora_kernels,
    check_quantizer,
    check_reasoning_parser,
    check_router,
    check_sampler,
    check_scheduler,
    check_speculator,
    check_structured_outputs_backend,
    check_tool_parser,
    check_transport,
)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend runs under Triton's interpreter
#: Where the layer kernels' check runs: the GPU when there is one (the triton kernels take CUDA tensors there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: Sampling parameters under which each first-party logits processor applies.
ACTIVATING_PARAMS = {
    "logit_bias": SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    "min_tokens": SamplingParams(min_tokens=4),
}
#: Outputs in each first-party tool-call parser's format (tests/parsers has more, and their expected calls).
TOOL_CALL_OUTPUTS = {
    "hermes": [
        'Let me check.\n\n<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',  # malformed: content
    ],
    "llama3_json": ['<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}', '{"a": 4}'],
    "mistral": ['Sure.[TOOL_CALLS] [{"name": "a", "arguments": {"x": "y"}}, {"name": "b", "arguments": {}}]'],
}
#: Outputs of a model that thinks between <think> and </think>.
THINKING_OUTPUTS = [
    "<think>\nThe user greets me.\n</think>\n\nHello!",
    "Okay, 2 + 2 = 4.\n</think>\n\n4",  # the template opened the thinking
    "<think>only thinking</think>",
    "a</b> <thin </think>c",
    "<think>never closed </thi",
]
#: Slots that have no conformance check (the model itself is checked against transformers; an engine backend
#: places real engines: tests/server/test_ray_backend.py serves through the first-party one).
UNCHECKED_SLOTS = {Slot.ARCHITECTURE, Slot.WEIGHT_FORMAT, Slot.ENGINE_BACKEND}


def _first_party() -> list[tuple[Slot, str]]:
    system = load_plugins(allowlist=[])
    return [
        (slot, registration.name)
        for slot in Slot
        if slot not in UNCHECKED_SLOTS
        for registration in system.registry.registrations(slot)
        if system.registry.plugins[registration.plugin].package == FIRST_PARTY_DISTRIBUTION
    ]


def _runnable(cls: Any, slot: Slot, name: str) -> None:
    """Skip what this machine cannot run (a GPU backend, kernels that need AVX2), saying why."""
    if slot in (Slot.ATTENTION_BACKEND, Slot.LAYER_KERNEL, Slot.LORA_KERNEL, Slot.FUSED_EXPERT) and name == "triton":
        pytest.importorskip("triton")
        return  # runs under the interpreter without a GPU
    devices = getattr(cls, "supported_devices", ("cpu",))
    if "cpu" not in devices and not torch.cuda.is_available():
        pytest.skip(f"{slot.value} {name!r} needs {devices}")
    if getattr(cls, "quant_methods", ()):  # takes packed tensors, not the float weights the kit feeds
        pytest.skip(f"{slot.value} {name!r} reads quantized checkpoints: tests/models/quantized checks it against "
                    "the tools that wrote them")  # fmt: skip
    if hasattr(cls, "is_available") and not cls.is_available():
        pytest.skip(f"{slot.value} {name!r} is not available on this machine")


@pytest.mark.parametrize(("slot", "name"), _first_party(), ids=lambda value: str(value))
def test_first_party_implementation_passes_its_check(slot: Slot, name: str, tmp_path: Path) -> None:
    cls = load_plugins(allowlist=[]).load(slot, name)
    _runnable(cls, slot, name)
    if slot is Slot.ATTENTION_BACKEND:
        interpreted = name == "triton" and not torch.cuda.is_available()
        # The interpreter runs each kernel instance in Python: one block size and head size there.
        grid = {"head_dims": (32,), "block_sizes": (16,)} if interpreted else {}
        check_attention_backend(cls, **grid)
    elif slot is Slot.LAYER_KERNEL:
        check_layer_kernels(cls, device=DEVICE, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    elif slot is Slot.FUSED_EXPERT:
        check_fused_experts(cls, device=DEVICE)
    elif slot is Slot.QUANTIZER:
        check_quantizer(cls)
    elif slot is Slot.SAMPLER:
        check_sampler(cls)
    elif slot is Slot.LOGITS_PROCESSOR:
        check_logits_processor(cls, ACTIVATING_PARAMS[name])
    elif slot is Slot.SCHEDULER:
        check_scheduler(cls)
    elif slot is Slot.KV_CACHE_MANAGER:
        check_kv_cache_manager(cls)
    elif slot is Slot.ROUTER:
        check_router(cls)
    elif slot is Slot.TRANSPORT:
        check_transport(cls)
    elif slot is Slot.SPECULATOR:
        if name != "ngram":
            pytest.skip(f"speculator {name!r} needs a model: tests/speculators/test_{name}.py runs its check")
        check_speculator(cls)
    elif slot is Slot.KV_TIER:
        if name == "zmq-push":
            pytest.skip("zmq-push keeps nothing (it sends): tests/kv_tiers/test_zmq_connector.py checks the pair")
        path = f"ipc://{tmp_path}/kv.sock" if name == "zmq-pull" else str(tmp_path)
        check_kv_tier(functools.partial(cls, path=path) if cls.takes_path else cls)
    elif slot is Slot.TOOL_PARSER:
        check_tool_parser(cls, TOOL_CALL_OUTPUTS[name])
    elif slot is Slot.REASONING_PARSER:
        check_reasoning_parser(cls, THINKING_OUTPUTS, added_tokens=("<think>", "</think>"))
    elif slot is Slot.STRUCTURED_OUTPUTS_BACKEND:
        check_structured_outputs_backend(cls)
    elif slot is Slot.LORA_KERNEL:
        dtypes = (torch.float32, torch.float16, torch.bfloat16)
        check_lora_kernels(cls, device="cpu" if name == "cpu" else DEVICE, dtypes=dtypes)
    else:
        pytest.fail(f"no conformance check is wired up for first-party {slot.value} {name!r}")


def test_every_checked_slot_has_a_first_party_implementation_or_a_reference() -> None:
    """KV tiers have no first-party implementation yet: the reference below stands in."""
    covered = {slot for slot, _ in _first_party()} | {Slot.KV_TIER}
    assert covered == set(Slot) - UNCHECKED_SLOTS


def test_in_memory_kv_tier_passes() -> None:
    check_kv_tier(DictKVTier)


class PromptLookupSpeculator(Speculator):
    """Drafts the tokens that followed the last earlier occurrence of the latest token."""

    name: ClassVar[str] = "prompt-lookup"

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        drafts = []
        for request in requests:
            tokens = list(request.token_ids)
            limit = min(self.num_speculative_tokens, request.max_num_tokens)
            earlier = [i for i in range(len(tokens) - 1) if tokens[i] == tokens[-1]]
            drafts.append(tokens[earlier[-1] + 1 :][:limit] if earlier and limit else [])
        return Proposal(drafts)


def test_reference_speculator_passes() -> None:
    check_speculator(PromptLookupSpeculator)


# ---------------------------------------------------------------- planted wrong implementations


def _fails(check: Callable[..., None], implementation: Any, *args: Any, match: str, **kwargs: Any) -> None:
    with pytest.raises(AssertionError, match=match):
        check(implementation, *args, **kwargs)


def test_fused_experts_that_drop_the_router_weights_fail() -> None:
    from tokenmill.layers.fused_experts import TorchFusedExperts

    class Unweighted(TorchFusedExperts):
        def apply(self, experts, x, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
            return super().apply(experts, x, torch.ones_like(topk_weights), topk_ids)

    _fails(check_fused_experts, Unweighted, match=r"Unweighted.apply\(tokens=1\): differs from the torch reference")


def test_attention_backend_with_a_wrong_scale_fails() -> None:
    from tokenmill.attention.torch_backend import TorchAttentionBackend

    class WrongScale(TorchAttentionBackend):
        def forward(self, layer: AttentionLayerSpec, *args: Any) -> torch.Tensor:
            return super().forward(dataclasses.replace(layer, scale=layer.head_dim**-0.5), *args)

    # Layer 0 uses head_dim**-0.5, so only the second layer (another scale) differs.
    _fails(check_attention_backend, WrongScale, match="layer 1 .*output differs from the reference")


def test_attention_backend_that_ignores_the_sliding_window_fails() -> None:
    from tokenmill.attention.torch_backend import TorchAttentionBackend

    class NoWindow(TorchAttentionBackend):
        def forward(self, layer: AttentionLayerSpec, *args: Any) -> torch.Tensor:
            return super().forward(dataclasses.replace(layer, sliding_window=None), *args)

    _fails(check_attention_backend, NoWindow, match=r"sliding_window=6\): output differs")


def test_attention_backend_that_stores_quantized_scales_its_own_way_fails() -> None:
    from tokenmill.attention.torch_backend import TorchAttentionBackend

    class NudgedScales(TorchAttentionBackend):
        """Writes int8 rows, then nudges every row's scale by one ulp: outputs stay within tolerance, bytes do not."""

        kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.int8,)

        def forward(self, layer: AttentionLayerSpec, *args: Any) -> torch.Tensor:
            out = super().forward(layer, *args)
            kv_cache = args[3]
            if kv_cache.dtype == torch.int8:
                kv_cache.view(torch.uint8)[..., -4] ^= 1  # the scale's lowest mantissa bit
            return out

    _fails(check_attention_backend, NudgedScales, match=r"kv_cache_dtype=torch.int8.*KV cache bytes differ")


def test_layer_kernels_that_skip_the_residual_add_fail() -> None:
    from tokenmill.layers.kernels import TorchLayerKernels

    class NoResidual(TorchLayerKernels):
        def add_rms_norm(
            self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return self.rms_norm(x, weight, eps), x

    _fails(check_layer_kernels, NoResidual, match=r"add_rms_norm\(dtype=torch.float32, tokens=1\) \(the sum\)")


def test_layer_kernels_that_rotate_the_wrong_halves_fail() -> None:
    from tokenmill.layers.kernels import TorchLayerKernels

    class Interleaved(TorchLayerKernels):
        """GPT-J's layout (pairs of neighbours) instead of Hugging Face's rotate-half."""

        def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            pairs = x.float().unflatten(-1, (-1, 2))
            x1, x2 = pairs[..., 0], pairs[..., 1]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)

    _fails(check_layer_kernels, Interleaved, match=r"rotary\(dtype=torch.float32, tokens=1\) \(head_dim=64\)")


def test_layer_kernels_whose_dense_matmul_drops_the_bias_fail() -> None:
    from tokenmill.layers.kernels import TorchLayerKernels

    class NoBias(TorchLayerKernels):
        def pack_dense_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
            return weight.clone()

        def dense_linear(
            self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
        ) -> torch.Tensor:
            return torch.nn.functional.linear(x, packed)

    _fails(check_layer_kernels, NoBias, match=r"dense_linear\(dtype=torch.float32, tokens=1\) \(45 x 96, bias=True\)")


def test_quantizer_that_drops_the_bias_fails() -> None:
    from tokenmill.layers.dense import DenseQuantizer

    class NoBias(DenseQuantizer):
        def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, layer.weight)

    _fails(check_quantizer, NoBias, match="differ from the loaded ones")


def test_quantizer_whose_matmul_disagrees_with_its_weights_fails() -> None:
    from tokenmill.layers.dense import DenseQuantizer

    class Skewed(DenseQuantizer):
        def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            out = super().apply(layer, x)
            return out * (1.0 + 0.05 * (x.abs().amax(-1, keepdim=True) > 1.5))  # wrong only off the identity

    _fails(check_quantizer, Skewed, match=r"but x @ W_dq.T \+ bias is")


def test_sampler_that_skips_logits_processors_fails() -> None:
    from tokenmill.sampling.sampler import SamplingMetadata, TorchSampler

    class NoProcessors(TorchSampler):
        def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
            return logits

    _fails(check_sampler, NoProcessors, match="where TorchSampler picks")


def test_sampler_that_ignores_seeds_fails() -> None:
    from tokenmill.sampling.sampler import SamplerOutput, SamplingMetadata, TorchSampler

    class Unseeded(TorchSampler):
        def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
            metadata.generators = {}
            metadata.unseeded_rows = (metadata.temperature != 0).nonzero().flatten()
            return super().__call__(logits, metadata)

    _fails(check_sampler, Unseeded, match="seed must give the same tokens")


def test_sampler_that_verifies_drafts_without_distributions_fails() -> None:
    from tokenmill.sampling.sampler import SamplingMetadata, TorchSampler

    class Unnormalised(TorchSampler):
        def target_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
            return logits.softmax(-1) * 2

    _fails(check_sampler, Unnormalised, match="are not distributions")

    class Undeclared(TorchSampler):
        verifies_drafts = False

        def target_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
            raise AssertionError("a sampler that does not verify drafts is never asked")

    check_sampler(Undeclared)


def test_logits_processor_that_changes_inactive_rows_fails() -> None:
    from tokenmill.sampling.logits_processor import LogitBiasLogitsProcessor

    class Leaky(LogitBiasLogitsProcessor):
        def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
            return super().apply(logits, rows, states) + 0.5  # every row

    _fails(check_logits_processor, Leaky, ACTIVATING_PARAMS["logit_bias"], match="which were not in rows")


def test_logits_processor_active_for_everyone_fails_unless_declared() -> None:
    class Everyone(LogitsProcessor):
        name: ClassVar[str] = "everyone"

        def is_active(self, row: SamplingRow) -> bool:
            return True

        def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
            logits[rows, 0] = float("-inf")
            return logits

    _fails(check_logits_processor, Everyone, SamplingParams(), match="pass inactive_params=None")
    check_logits_processor(Everyone, SamplingParams(), inactive_params=None)


def test_scheduler_that_leaks_a_block_fails() -> None:
    from tokenmill.request import Request, RequestStatus
    from tokenmill.scheduler import FCFSScheduler

    class LeakOnFinish(FCFSScheduler):
        def _finish(self, request: Request, status: RequestStatus) -> None:
            free = self.kv_cache.free
            self.kv_cache.free = lambda request_id: None  # type: ignore[method-assign]
            try:
                super()._finish(request, status)
            finally:
                self.kv_cache.free = free  # type: ignore[method-assign]

    _fails(check_scheduler, LeakOnFinish, match="KV blocks leaked")


def test_scheduler_over_its_token_budget_fails() -> None:
    from tokenmill.kv_cache.manager import KVCacheManager
    from tokenmill.scheduler import FCFSScheduler

    class OverBudget(FCFSScheduler):
        def __init__(self, kv_cache: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
            super().__init__(kv_cache, 2 * max_num_batched_tokens, max_num_seqs)

    _fails(check_scheduler, OverBudget, match="over max_num_batched_tokens=16")


def test_scheduler_that_ignores_aborts_fails() -> None:
    from tokenmill.messages import EngineCoreOutput
    from tokenmill.scheduler import FCFSScheduler

    class NoAborts(FCFSScheduler):
        def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
            return []

    _fails(check_scheduler, NoAborts, match="expected 'abort'")


def test_kv_cache_manager_without_copy_on_write_fails() -> None:
    class NoCopies(PagedKVCacheManager):
        def allocate_slots(
            self, request_id: str, num_computed_tokens: int, num_new_tokens: int, prefix: PrefixMatch | None = None
        ) -> SlotAllocation | None:
            allocation = super().allocate_slots(request_id, num_computed_tokens, num_new_tokens, prefix)
            return None if allocation is None else SlotAllocation(allocation.new_block_ids, copies=[])

    _fails(check_kv_cache_manager, NoCopies, match="shared partial block")


def test_kv_cache_manager_that_ignores_the_cache_salt_fails() -> None:
    class Unsalted(PagedKVCacheManager):
        def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
            return super().lookup_prefix(token_ids)

    _fails(check_kv_cache_manager, Unsalted, match="another cache_salt")


def test_kv_tier_that_evicts_in_arrival_order_fails() -> None:
    class FirstInFirstOut(DictKVTier):
        def fetch(self, block_hash: bytes) -> torch.Tensor | None:
            block = self._blocks.get(block_hash)
            if block is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            return block

    _fails(check_kv_tier, FirstInFirstOut, match="least recently used")


def test_kv_tier_that_keeps_the_callers_tensor_fails() -> None:
    class NoCopy(DictKVTier):
        def store(self, block_hash: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
            self._blocks[block_hash] = block
            return []

    _fails(check_kv_tier, NoCopy, match="kept rather than copied")


def test_router_that_returns_an_unhealthy_engine_fails() -> None:
    from tokenmill.routing import Router

    class FirstEngine(Router):
        name: ClassVar[str] = "first"

        def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
            return engines[0].index

    _fails(check_router, FirstEngine, match="must return the index of a healthy one", torch_free=False)


def test_router_whose_module_imports_torch_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = (
        "import torch\nfrom tokenmill.routing import RoundRobinRouter\n\nclass TorchyRouter(RoundRobinRouter): ...\n"
    )
    (tmp_path / "torchy_router.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the fresh interpreter the check starts
    from torchy_router import TorchyRouter  # type: ignore[import-not-found]

    _fails(check_router, TorchyRouter, match="imports torch")


def test_speculator_drafting_too_many_tokens_fails() -> None:
    class Greedy(PromptLookupSpeculator):
        def propose(self, requests: list[SpeculationInput]) -> Proposal:
            return Proposal([[1] * (self.num_speculative_tokens + 1) for _ in requests])

    _fails(check_speculator, Greedy, match="at most min")


def test_speculator_with_invalid_draft_probabilities_fails() -> None:
    class Unnormalised(PromptLookupSpeculator):
        def propose(self, requests: list[SpeculationInput]) -> Proposal:
            proposal = super().propose(requests)
            proposal.draft_probs = [torch.ones(len(drafts), 64) for drafts in proposal.token_ids]
            return proposal

    _fails(check_speculator, Unnormalised, match="not probability distributions")


def test_speculator_with_a_bad_draft_tree_fails() -> None:
    class Trees(PromptLookupSpeculator):
        supports_draft_trees = True

        def propose(self, requests: list[SpeculationInput]) -> Proposal:
            return Proposal([[1, 1][: min(2, r.max_num_tokens)] for r in requests],
                            parents=[[-1, -1][: min(2, r.max_num_tokens)] for r in requests])  # fmt: skip

    _fails(check_speculator, Trees, match="repeats token 1 under the same parent")

    class Undeclared(PromptLookupSpeculator):
        def propose(self, requests: list[SpeculationInput]) -> Proposal:
            return Proposal([[] for _ in requests], parents=[None for _ in requests])

    _fails(check_speculator, Undeclared, match="does not declare supports_draft_trees")


def test_transport_that_reorders_frames_fails() -> None:
    from tokenmill.transport.zmq_transport import ZmqTransport

    class Reordering(ZmqTransport):
        def connect(self, address: str) -> Any:
            connection = super().connect(address)
            pending: list[bytes] = []
            send = connection.send

            def send_in_pairs(frame: bytes) -> None:  # holds a frame back and sends it after the next
                pending.append(frame)
                if len(pending) == 2:
                    send(pending.pop())
                    send(pending.pop())

            connection.send = send_in_pairs
            return connection

    _fails(check_transport, Reordering, match="changed or out of order")


def test_lora_kernels_that_ignore_the_slot_fail() -> None:
    from tokenmill.lora.kernels import LoRABatch, TorchLoRAKernels

    class FirstSlot(TorchLoRAKernels):
        """Every token with an adapter reads slot 0's weights."""

        def add_lora(self, batch: LoRABatch, x: torch.Tensor, *args: Any) -> None:
            slots = batch.token_slots.clamp(max=0).cpu().numpy()
            super().add_lora(self.prepare(slots, x.device), x, *args)

    match = r"FirstSlot.add_lora\(x torch.float32, adapters torch.float32, 1 tokens, one slot: \[2\]\) .*differs"
    _fails(check_lora_kernels, FirstSlot, match=match + r" from the torch reference .* in rows \[0\] of slots \[2\]")


def test_lora_kernels_that_add_to_tokens_without_an_adapter_fail() -> None:
    from tokenmill.lora.kernels import LoRABatch, TorchLoRAKernels

    class Gathered(TorchLoRAKernels):
        """Gathers every token's weights by its slot, so -1 reads the last slot (Python's indexing)."""

        def add_lora(self, batch: LoRABatch, x: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                     offsets: Sequence[int], y: torch.Tensor) -> None:  # fmt: skip
            rank = lora_a.shape[1] // len(lora_b)
            slots = batch.token_slots
            h = torch.einsum("ti,tri->tr", x, lora_a[slots].to(x.dtype))
            for part, (b, offset) in enumerate(zip(lora_b, offsets, strict=True)):
                delta = torch.einsum("tr,tro->to", h[:, part * rank : (part + 1) * rank], b[slots].to(x.dtype))
                y[:, offset : offset + b.shape[2]] += delta.to(y.dtype)

    _fails(check_lora_kernels, Gathered, match=r"mixed slots.*changed the rows of tokens without an adapter")


def test_lora_kernels_that_add_in_the_adapters_dtype_fail() -> None:
    from tokenmill.lora.kernels import LoRABatch, TorchLoRAKernels

    class Narrow(TorchLoRAKernels):
        """Computes the products in the adapters' dtype, not the activations' (--lora-dtype float16)."""

        def add_lora(self, batch: LoRABatch, x: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                     offsets: Sequence[int], y: torch.Tensor) -> None:  # fmt: skip
            delta = torch.zeros_like(y, dtype=lora_a.dtype)
            super().add_lora(batch, x.to(lora_a.dtype), lora_a, lora_b, offsets, delta)
            y += delta.to(y.dtype)

    check_lora_kernels(Narrow, adapter_dtypes=(torch.float32,))
    _fails(check_lora_kernels, Narrow, match=r"adapters torch.float16.*differs from the torch reference")


def test_lora_kernels_that_round_the_whole_output_fail() -> None:
    from tokenmill.lora.kernels import LoRABatch, TorchLoRAKernels

    class RoundTrip(TorchLoRAKernels):
        """Adds in place, then writes y back through bfloat16, rows without an adapter too."""

        def add_lora(self, batch: LoRABatch, *args: Any) -> None:
            super().add_lora(batch, *args)
            y = args[-1]
            y.copy_(y.to(torch.bfloat16).to(y.dtype))

    _fails(check_lora_kernels, RoundTrip, match="changed the rows of tokens without an adapter")


def test_lora_kernels_that_bind_a_copy_of_the_slots_fail() -> None:
    from tokenmill.lora.kernels import BoundLoRA, TorchLoRAKernels

    class Snapshot(TorchLoRAKernels):
        """Binds copies of the slot tensors, so adapters loaded into the slots later are never seen."""

        def bind(self, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor], offsets: Sequence[int]) -> BoundLoRA:
            return super().bind(lora_a.clone(), [b.clone() for b in lora_b], offsets)

    match = r"Snapshot.bind\(x torch.float32, adapters torch.float32, 1 tokens, .*\) .*differs from the torch reference"
    _fails(check_lora_kernels, Snapshot, match=match)


# ---------------------------------------------------------------- planted structured-output backends


def _guidance() -> Any:
    from tokenmill_plugins.structured_outputs.guidance import GuidanceBackend, GuidanceGrammar

    return GuidanceBackend, GuidanceGrammar


def test_structured_outputs_backend_whose_mask_allows_everything_fails() -> None:
    GuidanceBackend, GuidanceGrammar = _guidance()

    class AllowAll(GuidanceGrammar):
        def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
            bitmask[index] = -1

    class AllowAllBackend(GuidanceBackend):
        def grammar(self, compiled: Any) -> Any:
            return AllowAll(compiled.deep_copy())

    _fails(check_structured_outputs_backend, AllowAllBackend,
           match=r"on the JSON schema .*: fill_bitmask .* allows tokens the constraint refuses")  # fmt: skip


def test_structured_outputs_backend_that_only_sets_allowed_bits_fails() -> None:
    GuidanceBackend, GuidanceGrammar = _guidance()

    class OrMask(GuidanceGrammar):
        """ORs the allowed tokens into the row: right on a row of zeros, all-allowed on the engine's rows of ones."""

        def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
            row = bitmask[index].clone()
            super().fill_bitmask(bitmask, index)
            bitmask[index] |= row

    class OrMaskBackend(GuidanceBackend):
        def grammar(self, compiled: Any) -> Any:
            return OrMask(compiled.deep_copy())

    _fails(check_structured_outputs_backend, OrMaskBackend, match="it must write every word of its row")


def test_structured_outputs_backend_whose_matchers_share_state_fails() -> None:
    GuidanceBackend, GuidanceGrammar = _guidance()

    class SharedBackend(GuidanceBackend):
        """Every request's matcher is the compiled one itself, not a copy."""

        def grammar(self, compiled: Any) -> Any:
            return GuidanceGrammar(compiled)

    _fails(check_structured_outputs_backend, SharedBackend, match="of a new matcher while another of the same compiled")


def test_structured_outputs_backend_that_cannot_roll_back_fails() -> None:
    GuidanceBackend, GuidanceGrammar = _guidance()

    class NoRollback(GuidanceGrammar):
        def rollback(self, num_tokens: int) -> None:
            pass

    class NoRollbackBackend(GuidanceBackend):
        def grammar(self, compiled: Any) -> Any:
            return NoRollback(compiled.deep_copy())

    _fails(check_structured_outputs_backend, NoRollbackBackend, match=r"accepting it all, then rollback\(2\)\) is True")


def test_structured_outputs_backend_that_compiles_anything_fails() -> None:
    from tokenmill.sampling_params import StructuredOutputsParams

    GuidanceBackend, _ = _guidance()

    class Lenient(GuidanceBackend):
        """Compiles a constraint it cannot read as any JSON object, and validates nothing."""

        validates = False

        def compile_grammar(self, params: StructuredOutputsParams) -> Any:
            try:
                return super().compile_grammar(params)
            except ValueError:
                return super().compile_grammar(StructuredOutputsParams(json_object=True))

    _fails(check_structured_outputs_backend, Lenient,
           match=r"compile_grammar\(a schema of an unknown type.*must raise ValueError")  # fmt: skip


def test_structured_outputs_backend_whose_compact_json_has_spaces_fails() -> None:
    """xgrammar's JSON without whitespace still has ": " and ", " unless given the separators (the first-party
    backend did so until this check found it)."""
    pytest.importorskip("xgrammar")
    from tokenmill_plugins.structured_outputs.xgrammar_backend import XgrammarBackend

    from tokenmill.sampling_params import StructuredOutputsParams

    class Spaced(XgrammarBackend):
        def compile_grammar(self, params: StructuredOutputsParams) -> Any:
            if not params.disable_any_whitespace:
                return super().compile_grammar(params)
            return self.compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)

    # the '"' after '{"color":', where this backend wants a space
    _fails(check_structured_outputs_backend, Spaced, match=r"validate_tokens after '' gave 8 \(it stops at 4 \('\"'\)")


# ---------------------------------------------------------------- planted parsers


def test_tool_parser_that_streams_a_markers_start_as_content_fails() -> None:
    from tokenmill_plugins.parsers.tool_parsers import HermesToolParser

    from tokenmill.parsers.tool_parser import PartialToolCalls

    class Eager(HermesToolParser):
        """Sends text as content until the whole marker is there, then takes back its start."""

        def extract_tool_calls_streaming(self, text: str) -> PartialToolCalls:
            if self.start not in text:
                return PartialToolCalls(text, [])
            return super().extract_tool_calls_streaming(text)

    match = r"in pieces of 1: at .*, the content went from '.*\\n<tool_call' to 'Let me check.\\n\\n'"
    _fails(check_tool_parser, Eager, TOOL_CALL_OUTPUTS["hermes"], match=match)


def test_tool_parser_that_drops_the_content_before_its_calls_fails() -> None:
    from tokenmill_plugins.parsers.tool_parsers import HermesToolParser

    from tokenmill.parsers.tool_parser import ExtractedToolCalls

    class NoContent(HermesToolParser):
        def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
            extracted = super().extract_tool_calls(text)
            return ExtractedToolCalls(extracted.calls, None) if extracted.calls else extracted

    _fails(check_tool_parser, NoContent, TOOL_CALL_OUTPUTS["hermes"],
           match=r"the stream's content joins into 'Let me check.\\n\\n', the whole output's is None")  # fmt: skip


def test_tool_parser_without_a_call_in_its_outputs_fails() -> None:
    from tokenmill_plugins.parsers.tool_parsers import HermesToolParser

    _fails(check_tool_parser, HermesToolParser, ["No call here."], match="give at least one output with a call")


def test_reasoning_parser_that_streams_a_markers_start_as_reasoning_fails() -> None:
    from tokenmill_plugins.parsers.reasoning_parsers import Qwen3ReasoningParser

    class Eager(Qwen3ReasoningParser):
        """Holds back nothing: '<think' goes out as reasoning, then is taken back once it is '<think>'."""

        def extract_reasoning_streaming(self, text: str) -> tuple[str, str]:
            body = text.split(self.start_token, 1)[-1]
            reasoning, ended, content = body.partition(self.end_token)
            return (reasoning, content) if ended else (body, "")

    _fails(check_reasoning_parser, Eager, THINKING_OUTPUTS, added_tokens=("<think>", "</think>"),
           match=r"in pieces of 1: the reasoning went from '<think' to '' at '<think>'")  # fmt: skip


def test_reasoning_parser_whose_whole_split_keeps_the_marker_fails() -> None:
    from tokenmill_plugins.parsers.reasoning_parsers import DeepSeekR1ReasoningParser

    class KeepsMarker(DeepSeekR1ReasoningParser):
        def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
            reasoning, content = super().extract_reasoning(text)
            return reasoning, None if content is None else self.end_token + content

    _fails(check_reasoning_parser, KeepsMarker, THINKING_OUTPUTS, added_tokens=("<think>", "</think>"),
           match=r"the stream joins into .*, the whole output splits into \('\\nThe user greets me.\\n', "
                 r"'</think>\\n\\nHello!'\)")  # fmt: skip
