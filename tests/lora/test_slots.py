"""Adapters in a bounded number of slots: requests wait for one, nothing leaks, no K/V is shared across adapters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.factories import make_engine, make_requests, make_scheduler, run_to_completion
from tokenmill import LoRARequest, SamplingParams
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.scheduler import FCFSScheduler


def _lora(i: int, path: Path | str = "/adapters/x") -> LoRARequest:
    return LoRARequest(f"a{i}", i, str(path))


def test_a_request_whose_adapter_has_no_slot_waits_while_others_run() -> None:
    scheduler = make_scheduler()
    assert isinstance(scheduler, FCFSScheduler)
    scheduler.max_loras = 2
    requests = make_requests(4, prompt_len=4, max_tokens=3)
    for request, lora in zip(requests, [_lora(1), _lora(2), _lora(3), None], strict=True):
        request.lora_request = lora
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert [s.request.request_id for s in output.scheduled] == ["r0", "r1", "r3"]  # r2's adapter would be a third
    assert dict(scheduler.running_loras) == {1: 1, 2: 1}
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, _tokens(output))
    assert not scheduler.running_loras


def _tokens(output):  # type: ignore[no-untyped-def]
    from tokenmill.scheduler import ModelRunnerOutput

    return ModelRunnerOutput(sampled_token_ids={r.request_id: [7] for _, r in output.sampling_requests})


def test_many_requests_over_more_adapters_than_slots_leave_nothing_behind(
    lora_model_dir: Path, adapters: list[Path]
) -> None:
    engine = make_engine(
        lora_model_dir, model={"dtype": "float32"},
        lora={"enable_lora": True, "max_loras": 2, "max_cpu_loras": 3}, scheduler={"max_num_seqs": 6},
    )  # fmt: skip
    loras = [_lora(i + 1, adapters[i]) for i in range(5)] + [None]
    alone = {}
    for i, lora in enumerate(loras):
        request = EngineCoreRequest(f"alone{i}", [9, 8, 7, 6, 5], _params(), [], now(), lora_request=lora)
        alone[i] = run_to_completion(engine, [request])[f"alone{i}"]
    requests = [
        EngineCoreRequest(f"r{n}", [9, 8, 7, 6, 5], _params(), [], now(), lora_request=loras[n % 6])
        for n in range(1000)
    ]
    tokens = run_to_completion(engine, requests)
    assert all(tokens[f"r{n}"] == alone[n % 6] for n in range(1000))
    assert engine.lora is not None and engine.lora.num_loads > 5  # adapters left host memory and came back
    assert len(engine.lora.slot_adapters) <= 2 and engine.lora.num_cpu_adapters <= 3
    assert not engine.scheduler.running_loras  # type: ignore[attr-defined]
    assert engine.kv_cache.num_free_blocks == engine.layout.num_blocks
    assert engine.kv_cache.usage == 0


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_prefix_cache_is_never_shared_across_adapters(lora_model_dir: Path, adapters: list[Path]) -> None:
    engine = make_engine(lora_model_dir, lora={"enable_lora": True, "max_loras": 2})
    prompt = list(range(10, 42))  # 8 full blocks of 4

    def cached(request_id: str, lora: LoRARequest | None) -> int:
        engine.add_request(EngineCoreRequest(request_id, prompt, _params(), [], now(), lora_request=lora))
        num_cached = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                num_cached = max(num_cached, output.num_cached_tokens)
        return num_cached

    a, b = _lora(1, adapters[0]), _lora(2, adapters[1])
    assert cached("a", a) == 0
    assert cached("b", b) == 0  # the same prompt under another adapter
    assert cached("base", None) == 0  # and under the base model
    assert cached("a-again", a) == 28  # the same adapter shares its blocks (all but the last token's)
    assert cached("base-again", None) == 28


def test_a_step_laid_out_as_the_last_reuses_its_layout_until_a_slot_changes(
    lora_model_dir: Path, adapters: list[Path]
) -> None:
    engine = make_engine(lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 2})
    manager = engine.lora
    assert manager is not None
    first = _lora(1, adapters[0])
    manager.set_batch([first, None], [1, 1])
    batch = manager.context.batch
    manager.set_batch([first, None], [1, 1])
    assert manager.context.batch is batch  # decode steps of one layout lay it out once
    manager.set_batch([first, None], [2, 1])
    assert manager.context.batch is not batch and manager.context.batch.num_tokens == 3
    slot = manager.slot_adapters[1]
    layer = manager.layers[0]
    before = layer.lora_a[slot].clone()
    manager.remove_adapter(1)  # unloaded, then loaded again under the same id from other weights
    manager.add_adapter(_lora(1, adapters[1]))
    manager.set_batch([_lora(1, adapters[1]), None], [2, 1])
    assert 1 in manager.slot_adapters
    assert not torch.equal(layer.lora_a[manager.slot_adapters[1]], before)  # the new weights, not the old slot's


_FIRST_ADAPTER_STEP = """
import json, sys
from tokenmill import LoRARequest, SamplingParams
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.testing.factories import make_engine

engine = make_engine(sys.argv[1], model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 2})
params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
engine.add_request(EngineCoreRequest("base", [9, 8, 7, 6, 5], params, [], now()))
while engine.has_unfinished_requests():
    engine.step()
before = set(sys.modules)
lora = LoRARequest("a1", 1, sys.argv[2])
engine.add_request(EngineCoreRequest("adapted", [9, 8, 7, 6, 5], params, [], now(), lora_request=lora))
while engine.has_unfinished_requests():
    engine.step()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_the_first_adapter_step_imports_nothing(lora_model_dir: Path, adapters: list[Path]) -> None:
    # An import on the engine loop holds every stream up (numpy.unique's first call imported numpy.ma: 60 ms).
    # In a fresh interpreter: this one has imported everything the other tests needed.
    done = subprocess.run([sys.executable, "-c", _FIRST_ADAPTER_STEP, str(lora_model_dir), str(adapters[0])],
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    assert json.loads(done.stdout.splitlines()[-1]) == []
