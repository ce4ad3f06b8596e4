"""The ``cpu`` layer kernels' fused decoder (``tokenmill_plugins.layer_kernels.cpu_decoder``): a Llama-shaped
stack of int4/int8 linears in one C++ call a step, bit for bit what its layers compute module by module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenmill_kernels.layer_kernels import cpu as layer_kernels
from tokenmill_kernels.paged_attention import cpu as paged_attention
from tokenmill_plugins.layer_kernels.cpu_decoder import CpuFusedDecoder

from tests.factories import make_engine, run_to_completion, save_hf_model
from tests.lora.conftest import save_peft_adapter
from tokenmill import LoRARequest
from tokenmill.engine import EngineCore, now
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_runner import SequenceChunk
from tokenmill.sampling_params import SamplingParams
from tokenmill.weights.safetensors_format import SafetensorsFormat

pytestmark = pytest.mark.skipif(not layer_kernels.is_available(), reason="the CPU kernels cannot build")

_PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [7] * 11, list(range(60, 90))]


def _model_dir(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides: Any) -> Path:
    directory = tmp_path_factory.mktemp(name)
    save_hf_model(name, directory, **overrides)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory, "llama-tiny")


def _engine(model_dir: Path, quantization: str = "int4", **sections: dict[str, Any]) -> EngineCore:
    model = {"quantization": quantization, "dtype": "float32", **sections.pop("model", {})}
    return make_engine(model_dir, model=model, **sections)


def _logits_both_ways(engine: EngineCore, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's logits for ``prompt`` in one step, with the fused decoder and module by module."""
    runner = engine.executor.runner
    model = runner.loaded.model
    fused = model.fused_decoder
    chunk = SequenceChunk(prompt, 0, list(range(-(-len(prompt) // runner.block_size))))
    with_fused = runner.execute([chunk], all_logits=True)
    model.fused_decoder = None
    try:
        by_modules = runner.execute([chunk], all_logits=True)
    finally:
        model.fused_decoder = fused
    return with_fused, by_modules


@pytest.mark.parametrize(
    ("name", "quantization"),
    [("llama-tiny", "int4"), ("llama-tiny", "int8"), ("llama-bias", "int4"), ("llama-tied", "int8"),
     ("qwen2-tiny", "int4"), ("qwen3-tiny", "int8"), ("mistral-tiny", "int4")],
)  # fmt: skip
def test_it_computes_what_the_layers_compute(tmp_path_factory: pytest.TempPathFactory, name: str,
                                             quantization: str) -> None:  # fmt: skip
    """Biases (Llama's attention and MLP, Qwen2's q/k/v), tied embeddings, Qwen3's q/k norms and Mistral's sliding
    window: the same logits, bit for bit, for a prompt chunk, and the same greedy tokens over decode steps of
    several requests."""
    engine = _engine(_model_dir(tmp_path_factory, name), quantization)
    model = engine.executor.runner.loaded.model
    assert isinstance(model.fused_decoder, CpuFusedDecoder)
    with_fused, by_modules = _logits_both_ways(engine, list(range(3, 40)))
    assert torch.equal(with_fused, by_modules)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for fused in (model.fused_decoder, None):
        model.fused_decoder = fused
        requests = [EngineCoreRequest(f"{i}", p, params, [], now()) for i, p in enumerate(_PROMPTS)]
        results.append(run_to_completion(engine, requests))
    assert results[0] == results[1]


class _Recorder:
    """Wraps a fused decoder: what each call returned (a tensor, or None for a step left to the layers)."""

    def __init__(self, fused: CpuFusedDecoder) -> None:
        self.fused = fused
        self.took: list[bool] = []

    def __call__(self, *args: Any) -> torch.Tensor | None:
        result = self.fused(*args)
        self.took.append(result is not None)
        return result


def test_long_prompt_chunks_and_hooked_steps_run_the_layers(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    model = engine.executor.runner.loaded.model
    recorder = _Recorder(model.fused_decoder)
    model.fused_decoder = recorder  # type: ignore[assignment]
    long_prompt = list(range(3, 103))  # longer than the cpu backend's kernel takes: SDPA attends it
    run_to_completion(engine, [EngineCoreRequest("long", long_prompt, SamplingParams(max_tokens=3), [], now())])
    assert recorder.took == [False, True, True]

    calls = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *_: calls.append(1))
    try:
        recorder.took.clear()
        run_to_completion(engine, [EngineCoreRequest("hooked", [5, 6, 7], SamplingParams(max_tokens=2), [], now())])
    finally:
        handle.remove()
    assert recorder.took == [False, False] and calls == [1, 1]


@pytest.mark.parametrize(
    "setting",
    [{"model": {"quantization": "none"}}, {"attention": {"backend": "torch"}}, {"model": {"layer_kernels": "torch"}}],
    ids=["dense", "torch-attention", "torch-layer-kernels"],
)
def test_it_is_not_built_for_what_it_does_not_reproduce(llama_dir: Path, setting: dict[str, Any]) -> None:
    assert _engine(llama_dir, **setting).executor.runner.loaded.model.fused_decoder is None


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two PEFT adapters over llama_dir's model (llama-tiny, seed 0)."""
    return [save_peft_adapter(tmp_path_factory.mktemp(f"adapter{i}"), seed=i + 1) for i in range(2)]


def _on(engine: EngineCore, lora: LoRARequest | None, name: str, params: SamplingParams) -> list[int]:
    return run_to_completion(engine, [EngineCoreRequest(name, [5, 6, 7], params, [], now(), lora_request=lora)])[name]


@pytest.mark.parametrize("lora_dtype", ["float32", "bfloat16"])
def test_it_adds_the_adapters_as_the_layers_do(llama_dir: Path, adapters: list[Path], lora_dtype: str) -> None:
    """The adapters' slots are attached after the model loaded (and warmed up through the stack): the stack is
    built again with them, and a step mixing two adapters and the base model gives the layers' logits bit for bit
    (the ``cpu`` LoRA kernels, called from C++); decode steps on an adapter run the stack and give the layers'
    tokens."""
    engine = _engine(llama_dir, lora={"enable_lora": True, "max_loras": 2, "lora_dtype": lora_dtype})
    assert engine.lora is not None
    model = engine.executor.runner.loaded.model
    recorder = _Recorder(model.fused_decoder)
    model.fused_decoder = recorder  # type: ignore[assignment]
    loras = [LoRARequest("a", 1, str(adapters[0])), None, LoRARequest("b", 2, str(adapters[1]))]
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [7] * 11]
    chunks = [SequenceChunk(p, 0, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]) for i, p in enumerate(prompts)]
    runner = engine.executor.runner
    engine.lora.set_batch(loras, [len(p) for p in prompts])
    with_fused = runner.execute(chunks, all_logits=True)
    assert recorder.took == [True]
    model.fused_decoder = None
    by_modules = runner.execute(chunks, all_logits=True)
    engine.lora.set_batch([None], [1])
    base = runner.execute(chunks, all_logits=True)
    assert torch.equal(with_fused, by_modules)
    for rows in (slice(0, 5), slice(8, 19)):  # each adapter changed its request's logits, the base row none
        assert not torch.equal(with_fused[rows], base[rows])
    assert torch.equal(with_fused[5:8], base[5:8])

    # One token on an adapter: its products run inside each matmul's parallel region, in shares of the rank.
    decode = [SequenceChunk([10], 5, [0, 1, 2, 3])]
    logits = {}
    for name, decoder, lora in (("fused", recorder, loras[0]), ("modules", None, loras[0]), ("base", None, None)):
        model.fused_decoder = decoder
        engine.lora.set_batch([lora], [1])
        logits[name] = runner.execute(decode, all_logits=True)
    assert torch.get_num_threads() > 1 and recorder.took[-1]
    assert torch.equal(logits["fused"], logits["modules"]) and not torch.equal(logits["fused"], logits["base"])

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_layers = _on(engine, loras[0], "layers", params)
    model.fused_decoder = recorder  # type: ignore[assignment]
    recorder.took.clear()
    assert _on(engine, loras[0], "fused", params) == by_layers
    assert recorder.took == [True] * 4
    assert by_layers != _on(engine, None, "base", params)  # the adapter did change the tokens


def test_other_lora_kernels_leave_adapter_steps_to_the_layers(llama_dir: Path, adapters: list[Path]) -> None:
    """Under the ``torch`` LoRA kernels a step where a token uses an adapter runs the layers; a step of
    base-model requests only still runs the stack, and gives what the layers give."""
    engine = _engine(llama_dir, lora={"enable_lora": True, "lora_kernels": "torch"})
    model = engine.executor.runner.loaded.model
    recorder = _Recorder(model.fused_decoder)
    model.fused_decoder = recorder  # type: ignore[assignment]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    on_adapter = _on(engine, LoRARequest("a", 1, str(adapters[0])), "a", params)
    assert recorder.took == [False, False, False]
    recorder.took.clear()
    base = _on(engine, None, "b", params)
    assert recorder.took == [True, True, True]
    model.fused_decoder = None
    assert _on(engine, None, "c", params) == base
    assert on_adapter != base


def test_weights_loaded_again_are_read_again(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    prompt = list(range(3, 20))
    before, _ = _logits_both_ways(engine, prompt)
    other = _model_dir(tmp_path_factory, "llama-tiny", seed=1)
    model = engine.executor.runner.loaded.model
    model.load_weights(SafetensorsFormat().iter_tensors(other))
    with_fused, by_modules = _logits_both_ways(engine, prompt)
    assert not torch.equal(before, by_modules)  # the weights did change
    assert torch.equal(with_fused, by_modules)


def test_the_stack_checks_what_it_is_given() -> None:
    norm = torch.ones(64)
    with pytest.raises(ValueError, match="a stack of 1 layers takes 4 linears and 3 norms, got 0 and 3"):
        layer_kernels.decoder_stack([], [norm] * 3, [(4, 2, 16, 0.25, 0, 0.0)], 1e-6)
    capsule = paged_attention.c_api()
    with pytest.raises(ValueError, match="expected a capsule of tokenmill.quant_matmul.api.v2, got "
                                         "tokenmill.paged_attention.api.v1"):  # fmt: skip
        layer_kernels.load()
        layer_kernels._EXTENSION.load().DecoderStack([], [norm], [], 1e-6, capsule, capsule)


def test_the_stack_checks_its_adapters_and_head_norms(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(llama_dir, lora={"enable_lora": True})
    fused = engine.executor.runner.loaded.model.fused_decoder
    assert isinstance(fused, CpuFusedDecoder)
    given: list[tuple[Any, ...]] = []
    monkeypatch.setattr(layer_kernels, "decoder_stack", lambda *args: given.append(args))
    fused._build()
    monkeypatch.undo()
    linears, norms, attention, eps, lora_weights, _ = given[0]
    assert len(lora_weights) == len(linears) and all(w is not None for w in lora_weights)
    with pytest.raises(ValueError, match=r"lora_weights\[1\] is not the LoRA extension's Weights"):
        layer_kernels.decoder_stack(linears, norms, attention, eps, [lora_weights[0], object(), *lora_weights[2:]])
    with pytest.raises(ValueError, match=f"lora_weights takes one entry per linear \\({len(linears)}\\)"):
        layer_kernels.decoder_stack(linears, norms, attention, eps, lora_weights[:-1])
    step = [torch.zeros(1)] * 3 + [[]] + [torch.zeros(1)] * 4  # checked after the plan
    with pytest.raises(ValueError, match="lora_plan is not the LoRA extension's Plan"):
        layer_kernels.decoder_stack(linears, norms, attention, eps, lora_weights).forward(*step, object())
    with pytest.raises(ValueError, match="a LoRA plan given to a stack built without LoRA weights"):
        layer_kernels.decoder_stack(linears, norms, attention, eps).forward(*step, object())
    with pytest.raises(ValueError, match=r"qk_norms takes each layer's q and k norm \(4\), got 1"):
        layer_kernels.decoder_stack(linears, norms, attention, eps, None, norms[:1])
