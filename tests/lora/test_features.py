"""Everything else keeps working with adapters: preemption, n > 1, n-gram speculative decoding, async scheduling;
and an adapter read from disk never stalls the other requests (it is read and staged a slice a step)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.factories import make_engine
from tokenmill import LoRARequest, SamplingParams
from tokenmill.engine import EngineCore, now
from tokenmill.lora import manager as lora_manager
from tokenmill.lora.layers import LinearLoRA
from tokenmill.messages import EngineCoreRequest, completion_request_id

_PROMPTS = [[9, 8, 7, 6, 5], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43, 40, 41, 42], [5, 6, 5, 6, 5, 6]]


def _loras(adapters: list[Path]) -> list[LoRARequest | None]:
    return [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters[:3])] + [None]


def _params(**options: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **options})


def _run(engine: EngineCore, requests: list[EngineCoreRequest]) -> dict[tuple[str, int], list[int]]:
    """Each completion's tokens, by (request id, completion index)."""
    for request in requests:
        engine.add_request(request)
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            tokens.setdefault((output.request_id, output.index), []).extend(output.new_token_ids)
    return tokens


def _requests(loras: list[LoRARequest | None], count: int, **options: Any) -> list[EngineCoreRequest]:
    return [
        EngineCoreRequest(f"r{n}", _PROMPTS[n % len(_PROMPTS)], _params(**options), [], now(),
                          lora_request=loras[n % len(loras)])
        for n in range(count)
    ]  # fmt: skip


def _alone(lora_model_dir: Path, loras: list[LoRARequest | None], count: int) -> dict[str, list[int]]:
    """Each request's greedy tokens run one at a time, without any other feature."""
    engine = make_engine(lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 4})
    return {r.request_id: _run(engine, [r])[(r.request_id, 0)] for r in _requests(loras, count)}


@pytest.fixture(scope="module")
def alone(lora_model_dir: Path, adapters: list[Path]) -> dict[str, list[int]]:
    return _alone(lora_model_dir, _loras(adapters), 8)


def test_preempted_requests_recompute_under_their_adapter(
    lora_model_dir: Path, adapters: list[Path], alone: dict[str, list[int]]
) -> None:
    engine = make_engine(
        lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 2},
        cache={"num_kv_blocks": 14},
    )  # fmt: skip
    tokens = _run(engine, _requests(_loras(adapters), 8))
    assert engine.scheduler.num_preemptions > 0  # type: ignore[attr-defined]
    assert {request_id: t for (request_id, _), t in tokens.items()} == alone
    assert engine.kv_cache.num_free_blocks == engine.layout.num_blocks


def test_n_greater_than_one_forks_keep_the_adapter(
    lora_model_dir: Path, adapters: list[Path], alone: dict[str, list[int]]
) -> None:
    engine = make_engine(lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 2})
    tokens = _run(engine, _requests(_loras(adapters), 8, n=3))
    assert len(tokens) == 8 * 3
    for (request_id, index), completion in tokens.items():  # completion i > 0 reports as "<id>#i"
        assert request_id == completion_request_id(request_id.partition("#")[0], index)
        assert completion == alone[request_id.partition("#")[0]]  # greedy: each completion is the request's alone
    assert not engine.scheduler.running_loras  # type: ignore[attr-defined]


def test_ngram_speculation_is_verified_by_the_target_with_the_adapter(
    lora_model_dir: Path, adapters: list[Path], alone: dict[str, list[int]]
) -> None:
    engine = make_engine(
        lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 4},
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )  # fmt: skip
    # 32 requests (the 8 of `alone`, four times): on a random model a draft is accepted only by chance, and which
    # steps propose drafts varies from run to run; 8 requests sometimes saw none accepted.
    tokens = _run(engine, _requests(_loras(adapters), 32))
    for (request_id, _), completion in tokens.items():
        assert completion == alone[f"r{int(request_id[1:]) % 8}"]
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_async_scheduling_with_adapters(
    lora_model_dir: Path, adapters: list[Path], alone: dict[str, list[int]]
) -> None:
    engine = make_engine(
        lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 2},
        scheduler={"async_scheduling": True},
    )  # fmt: skip
    assert type(engine.loop).__name__ == "AsyncSchedulingLoop"
    tokens = _run(engine, _requests(_loras(adapters), 8))
    assert {request_id: t for (request_id, _), t in tokens.items()} == alone


def _read_in_slices(monkeypatch: pytest.MonkeyPatch, adapter: Path, slices: int) -> None:
    """Make an adapter's read take ``slices`` polls: one chunk each."""
    size = (adapter / "adapter_model.safetensors").stat().st_size
    monkeypatch.setattr(lora_manager, "_READ_SLICE_S", 0.0)
    monkeypatch.setattr(lora_manager, "_READ_CHUNK_BYTES", size // slices + 1)


def test_an_adapter_read_from_disk_does_not_stall_other_requests(
    lora_model_dir: Path, adapters: list[Path], alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 2})
    assert engine.lora is not None
    _read_in_slices(monkeypatch, adapters[0], slices=10)
    requests = _requests(_loras(adapters), 4)  # r3 has no adapter, r0 adapter a0
    engine.add_request(requests[3])  # the base model's request runs
    engine.add_request(requests[0])  # its adapter is being read, a slice a step: it waits
    tokens: dict[str, list[int]] = {"r0": [], "r3": []}
    for _ in range(6):  # the other request keeps stepping meanwhile, one token a step
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert len(tokens["r3"]) == 6 and tokens["r0"] == []
    assert engine.stats().waiting_lora_adapters == ["a0"] and engine.lora.num_cpu_adapters == 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens == {"r0": alone["r0"], "r3": alone["r3"]}
    assert engine.lora.num_cpu_adapters == 1 and engine.lora.num_loads == 1


def test_an_adapter_is_staged_a_module_a_step_while_it_is_read(
    lora_model_dir: Path, adapters: list[Path], alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 2})
    assert engine.lora is not None
    _read_in_slices(monkeypatch, adapters[0], slices=2)  # and, with no time per slice, one module staged a poll
    staged_in_step = [0]
    stage = LinearLoRA.stage

    def counted(self: LinearLoRA, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        staged_in_step[-1] += 1
        return stage(self, *args)

    monkeypatch.setattr(LinearLoRA, "stage", counted)
    requests = _requests(_loras(adapters), 4)
    engine.add_request(requests[3])
    engine.add_request(requests[0])  # on a0: read, then staged, a slice a step; copied into a slot when it joins
    tokens: dict[str, list[int]] = {"r0": [], "r3": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        staged_in_step.append(0)
    assert tokens == {"r0": alone["r0"], "r3": alone["r3"]}
    # Every module once, none twice, and no step (the join's least of all) staged more than one.
    assert sum(staged_in_step) == len(engine.lora.targets) and max(staged_in_step) == 1
    (weights,) = engine.lora._cpu.values()
    staged = [tensor for parts in weights.layers.values() for pair in parts.values() for tensor in pair]
    assert len(staged) == 2 * len(engine.lora.targets)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in staged)


def test_an_adapter_whose_weights_cannot_be_read_fails_its_requests_only(
    lora_model_dir: Path, adapters: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True})
    assert engine.lora is not None
    adapter = tmp_path / "a0"
    shutil.copytree(adapters[0], adapter)
    weights = adapter / "adapter_model.safetensors"
    _read_in_slices(monkeypatch, adapter, slices=4)
    lora = LoRARequest("a0", 1, str(adapter))
    for request_id in ("bad", "base"):
        engine.add_request(EngineCoreRequest(request_id, [1, 2, 3], _params(max_tokens=2), [], now(),
                                             lora_request=lora if request_id == "bad" else None))  # fmt: skip
    weights.rename(tmp_path / "away")  # the file goes while it is being read
    errors: dict[str, str | None] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            errors[output.request_id] = output.error
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert errors["base"] is None and len(tokens["base"]) == 2
    assert errors["bad"] is not None and "No such file" in errors["bad"] and str(weights) in errors["bad"]
    (tmp_path / "away").rename(weights)  # the next request naming the adapter reads it again
    assert len(_run(engine, [EngineCoreRequest("good", [1, 2, 3], _params(max_tokens=2), [], now(),
                                               lora_request=lora)])[("good", 0)]) == 2  # fmt: skip
    engine.lora.remove_adapter(1)
    engine.add_request(EngineCoreRequest("grown", [1, 2, 3], _params(max_tokens=2), [], now(), lora_request=lora))
    with weights.open("ab") as f:  # the file grows between the check and the end of the read
        f.write(b"\0" * 64)
    outputs = [output for _ in range(10) for output in engine.step()]
    assert [(o.request_id, o.finished) for o in outputs] == [("grown", True)]
    assert outputs[0].error is not None and "changed while it was read" in outputs[0].error
