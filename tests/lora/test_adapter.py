"""Reading and checking PEFT adapters: a wrong base or an unsupported option is one line naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.factories import make_engine
from tests.lora.conftest import save_peft_adapter
from tokenmill import LoRARequest, SamplingParams
from tokenmill.engine import now
from tokenmill.lora.adapter import LoRAAdapterError, linear_shapes, read_adapter
from tokenmill.messages import EngineCoreRequest
from tokenmill.sampling_params import InvalidRequestError

#: llama-tiny: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 128.
SHAPES = linear_shapes(2, 64, 4, 2, 16, 128)


def test_ranks_and_scalings_follow_peft(adapters: list[Path]) -> None:
    plain = read_adapter(adapters[0], SHAPES, max_lora_rank=16)
    assert len(plain.modules) == 14
    assert {(m.rank, m.scaling) for m in plain.modules.values()} == {(8, 2.0)}
    rslora = read_adapter(adapters[2], SHAPES, max_lora_rank=16)
    assert {m.scaling for m in rslora.modules.values()} == {8 / math.sqrt(16)}
    patterned = read_adapter(adapters[3], SHAPES, max_lora_rank=16)
    layer0 = {name.rsplit(".", 1)[-1]: m for name, m in patterned.modules.items() if ".0." in name}
    assert sorted(layer0) == ["o_proj", "q_proj", "v_proj"]
    assert (layer0["v_proj"].rank, layer0["v_proj"].scaling) == (2, 16 / 2)
    assert (layer0["o_proj"].rank, layer0["o_proj"].scaling) == (8, 4 / 8)


def test_rank_above_max_lora_rank(adapters: list[Path]) -> None:
    with pytest.raises(LoRAAdapterError, match=r"rank 16, above lora.max_lora_rank=8; raise --max-lora-rank"):
        read_adapter(adapters[2], SHAPES, max_lora_rank=8)


def test_wrong_base_shapes(tmp_path: Path) -> None:
    adapter = save_peft_adapter(tmp_path / "wide", base_config={"hidden_size": 96})
    with pytest.raises(
        LoRAAdapterError, match=r"down_proj is 128 -> 96 in the adapter but 128 -> 64 in the base model"
    ):
        read_adapter(adapter, SHAPES, max_lora_rank=16)


def test_module_the_base_lacks(tmp_path: Path) -> None:
    adapter = save_peft_adapter(tmp_path / "deep", base_config={"num_hidden_layers": 3}, target_modules=["q_proj"])
    with pytest.raises(LoRAAdapterError, match=r"weights for model.layers.2.self_attn.q_proj, which the base model"):
        read_adapter(adapter, SHAPES, max_lora_rank=16)


def test_unknown_target_module(tmp_path: Path) -> None:
    adapter = save_peft_adapter(tmp_path / "head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoRAAdapterError, match=r"target module 'lm_head' is not one tokenmill adapts"):
        read_adapter(adapter, SHAPES, max_lora_rank=16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "LoRA adapters only"),
        ({"r": 0}, "r=0"),
    ],
)
def test_unsupported_options(adapters: list[Path], tmp_path: Path, change: dict[str, object], message: str) -> None:
    directory = tmp_path / "changed"
    directory.mkdir()
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (directory / "adapter_model.safetensors").write_bytes((adapters[0] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(directory, SHAPES, max_lora_rank=16)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match="no such directory"):
        read_adapter(tmp_path / "nowhere", SHAPES, max_lora_rank=16)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path, SHAPES, max_lora_rank=16)


def test_engine_refuses_a_wrong_base_in_one_line(lora_model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(lora_model_dir, lora={"enable_lora": True})
    adapter = save_peft_adapter(tmp_path / "wide", base_config={"hidden_size": 96})
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), [], now(),
                                lora_request=LoRARequest("wide", 1, str(adapter)))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="in the adapter but 128 -> 64 in the base model") as info:
        engine.add_request(request)
    assert "\n" not in str(info.value)
    assert not engine.has_unfinished_requests()


def test_engine_without_lora_refuses_adapters(lora_model_dir: Path, adapters: list[Path]) -> None:
    engine = make_engine(lora_model_dir)
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), [], now(),
                                lora_request=LoRARequest("a", 1, str(adapters[0])))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled; start the engine with --enable-lora"):
        engine.add_request(request)


def test_front_end_shapes_leave_a_mixture_of_experts_to_the_engine(tmp_path: Path, lora_model_dir: Path) -> None:
    """The front end checks adapters against a dense Llama's linears from config.json; a MoE model's MLPs are not
    those (a shared expert, routed experts), so it leaves the check to the engine, which reads the modules."""
    from tokenmill.lora.registry import base_linear_shapes
    from tokenmill.testing.factories import save_hf_model

    dense = base_linear_shapes(lora_model_dir)
    assert dense is not None and "model.layers.0.mlp.gate_proj" in dense
    save_hf_model("qwen2-moe-tiny", tmp_path / "moe")
    assert base_linear_shapes(tmp_path / "moe") is None


def test_fused_experts_adapters_are_checked_against_the_experts(tmp_path: Path) -> None:
    """PEFT's adapter on a MoE model's fused experts parameters: per expert modules against the base's experts;
    the front end (no base shapes) checks the tensors alone; experts of another width are one line."""
    from tokenmill.testing.factories import save_tiny_model

    adapter = save_peft_adapter(tmp_path / "adapter", base="qwen3-moe-tiny")
    assert read_adapter(adapter, None, 16).modules  # attention's; the experts' wait for the engine
    engine = make_engine(save_tiny_model(tmp_path / "base", "qwen3-moe-tiny"), lora={"enable_lora": True,
                         "max_lora_rank": 16})  # fmt: skip
    assert engine.lora is not None
    checked = read_adapter(adapter, engine.lora.linear_shapes, 16)
    gate, up, down = (checked.modules[f"model.layers.0.mlp.experts.7.{leaf}"] for leaf in ("gate_proj", "up_proj",
                                                                                             "down_proj"))  # fmt: skip
    assert (gate.rank, gate.out_rows, up.out_rows, gate.num_experts, down.rank) == (16, (0, 32), (32, 64), 8, 8)
    with pytest.raises(LoRAAdapterError, match="rank 16, above lora.max_lora_rank=8"):
        read_adapter(adapter, engine.lora.linear_shapes, 8)
    other = make_engine(save_tiny_model(tmp_path / "other", "qwen3-moe-tiny", moe_intermediate_size=48),
                        lora={"enable_lora": True, "max_lora_rank": 16})  # fmt: skip
    assert other.lora is not None
    with pytest.raises(LoRAAdapterError, match=r"experts is 32 -> 64 in the adapter, which is neither the experts' "
                                               r"gate_up_proj \(64 -> 96\) nor their down_proj"):  # fmt: skip
        read_adapter(adapter, other.lora.linear_shapes, 16)
