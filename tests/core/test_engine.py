"""The engine loop end to end on tiny models: greedy parity with transformers, batching
invariance under chunked prefill and preemption, prefix caching, n > 1, no block leaks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.sampling_params import InvalidRequestError, SamplingParams

GREEDY_64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def _request(request_id: str, prompt: list[int], params: SamplingParams = GREEDY_64, **kwargs) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, params, [], now(), **kwargs)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    save_hf_model("llama-tiny", directory)
    return directory


@pytest.mark.parametrize(
    "name",
    [
        "llama-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
        "mistral-tiny",
        "gemma2-tiny",
        "gemma3-tiny",
        "phi3-longrope",
        "qwen3-moe-tiny",
        "qwen2-moe-tiny",
        "mixtral-tiny",
        "granite-tiny",
        "olmo2-tiny",
    ],
)
def test_greedy_matches_transformers_generate(name: str, tmp_path: Path) -> None:
    hf_model = save_hf_model(name, tmp_path)
    engine = make_engine(tmp_path, scheduler={"max_num_batched_tokens": 24})  # forces chunked prefill
    prompts = _prompts([5, 37, 12], seed=7)
    eos = hf_model.generation_config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    # min_tokens bans EOS for 64 tokens, exactly what transformers' min_new_tokens does.
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
    requests = [EngineCoreRequest(str(i), p, params, eos_ids, now()) for i, p in enumerate(prompts)]
    outputs = run_to_completion(engine, requests)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert outputs[str(i)] == expected


def test_batching_invariance_with_chunked_prefill_and_preemption(llama_dir: Path) -> None:
    rng = random.Random(0)
    lengths = [4, 600, *[rng.randrange(4, 601) for _ in range(22)]]
    prompts = _prompts(lengths, seed=1)
    alone = {}
    solo_engine = make_engine(llama_dir, cache={"num_kv_blocks": 200})
    for i, prompt in enumerate(prompts):
        alone.update(run_to_completion(solo_engine, [_request(str(i), prompt)]))
    # 64-token steps read long prompts over many steps; 120 blocks of 4 tokens cannot hold
    # everyone's context at once, so running requests get preempted and recompute.
    engine = make_engine(llama_dir, cache={"num_kv_blocks": 200}, scheduler={"max_num_batched_tokens": 64})
    together = run_to_completion(engine, [_request(str(i), p) for i, p in enumerate(prompts)])
    assert engine.stats().num_preemptions > 0
    assert together == alone
    assert engine.kv_cache.num_free_blocks == 200 and engine.kv_cache.usage == 0


def _record_scheduled_tokens(engine) -> dict[str, int]:  # type: ignore[no-untyped-def]
    computed: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        output = schedule()
        for scheduled in output.scheduled:
            request_id = scheduled.request.request_id
            computed[request_id] = computed.get(request_id, 0) + scheduled.num_new_tokens
        return output

    engine.scheduler.schedule = recording_schedule
    return computed


def test_prefix_caching_computes_only_the_uncached_suffix(llama_dir: Path) -> None:
    shared, first_tail, second_tail = _prompts([256, 9, 13], seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = make_engine(llama_dir)
    computed = _record_scheduled_tokens(engine)
    first = run_to_completion(engine, [_request("a", shared + first_tail, params)])
    hits_before = engine.stats().prefix_cache_hits
    second = run_to_completion(engine, [_request("b", shared + second_tail, params)])
    assert engine.stats().prefix_cache_hits - hits_before == 256
    # Prompt suffix, then one decode step per generated token but the last.
    assert computed["b"] == len(second_tail) + 7
    assert computed["a"] == 256 + len(first_tail) + 7

    uncached = make_engine(llama_dir, cache={"enable_prefix_caching": False})
    assert run_to_completion(uncached, [_request("a", shared + first_tail, params)]) == first
    assert run_to_completion(uncached, [_request("b", shared + second_tail, params)]) == second
    assert uncached.stats().prefix_cache_hits == 0


def test_no_block_leaks_after_aborts_mid_way(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, scheduler={"max_num_batched_tokens": 32})
    prompts = _prompts([30, 50, 7, 90, 3, 64], seed=5)
    for i, prompt in enumerate(prompts):
        engine.add_request(_request(str(i), prompt))
    for _ in range(6):
        engine.step()
    assert engine.kv_cache.usage > 0
    aborted = engine.abort_requests(["0", "3", "5", "no-such-request"])
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("0", "abort"), ("3", "abort"), ("5", "abort")]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.usage == 0
    assert engine.kv_cache.num_free_blocks == engine.layout.num_blocks
    engine.kv_cache.check_invariants()


def test_n_completions_share_the_prompt_blocks(llama_dir: Path) -> None:
    prompt = _prompts([40], seed=9)[0]
    engine = make_engine(llama_dir)
    engine.add_request(
        _request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True))
    )
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        if len(outputs) == 3 and all(len(v) == 1 for v in outputs.values()):
            # Right after the fork: the 40-token prompt's 10 blocks are shared three ways, and
            # each completion has at most a private copy of the block its next token goes into.
            assert engine.kv_cache.usage * engine.layout.num_blocks <= 10 + 3
    assert sorted(outputs) == ["r", "r#1", "r#2"]
    assert all(len(tokens) == 5 for tokens in outputs.values())
    assert len({tuple(tokens) for tokens in outputs.values()}) == 3  # sampled independently

    again = make_engine(llama_dir)
    again.add_request(_request("other", prompt[:9], SamplingParams(temperature=1.0, max_tokens=7)))
    repeated = run_to_completion(
        again, [_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True))]
    )
    assert {k: repeated[k] for k in outputs} == outputs  # same seed, different batch: same tokens


def test_seeded_request_is_independent_of_batch(llama_dir: Path) -> None:
    prompt = _prompts([12], seed=4)[0]
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = run_to_completion(make_engine(llama_dir), [_request("x", prompt, params)])["x"]
    crowd = [
        _request(f"c{i}", p, SamplingParams(temperature=1.0, max_tokens=30))
        for i, p in enumerate(_prompts([8, 40, 3, 17], seed=6))
    ]
    together = run_to_completion(make_engine(llama_dir), [*crowd[:2], _request("x", prompt, params), *crowd[2:]])
    assert together["x"] == alone


def test_min_tokens_and_stop_token_ids(llama_dir: Path) -> None:
    prompt = _prompts([10], seed=8)[0]
    greedy = run_to_completion(make_engine(llama_dir), [_request("g", prompt)])["g"]
    stop_at = greedy[5]
    first_index = greedy.index(stop_at)
    engine = make_engine(llama_dir)
    stopped = run_to_completion(
        engine, [_request("s", prompt, SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[stop_at]))]
    )["s"]
    assert stopped == greedy[: first_index + 1]
    # min_tokens bans the stop token until enough tokens exist, so the run continues past it.
    late = run_to_completion(
        make_engine(llama_dir),
        [
            _request(
                "m",
                prompt,
                SamplingParams(temperature=0, max_tokens=64, min_tokens=first_index + 2, stop_token_ids=[stop_at]),
            )
        ],
    )["m"]
    assert len(late) > first_index + 1 and stop_at not in late[: first_index + 2]


def test_eos_ends_a_request_unless_ignored(llama_dir: Path) -> None:
    prompt = _prompts([10], seed=8)[0]
    greedy = run_to_completion(make_engine(llama_dir), [_request("g", prompt)])["g"]
    eos = greedy[3]
    engine = make_engine(llama_dir)
    engine.add_request(EngineCoreRequest("e", prompt, SamplingParams(temperature=0, max_tokens=64), [eos], now()))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == greedy[: greedy.index(eos) + 1]
    assert outputs[-1].finish_reason == "stop"
    assert (
        run_to_completion(make_engine(llama_dir), [EngineCoreRequest("i", prompt, GREEDY_64, [eos], now())])["i"]
        == greedy
    )


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        ([1, 512], "prompt token id 512 is outside the vocabulary (0..511)"),
        (list(range(100)) * 11, "the prompt has 1100 tokens; the context window is 1024"),
    ],
)
def test_invalid_prompts_are_rejected_and_the_engine_keeps_serving(llama_dir: Path, prompt, message) -> None:
    engine = make_engine(llama_dir)
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.add_request(_request("bad", prompt))
    assert run_to_completion(engine, [_request("good", [1, 2, 3], SamplingParams(max_tokens=3))])["good"]


def test_the_kv_cache_is_touched_only_as_far_as_the_load_has_needed(llama_dir: Path) -> None:
    """The gauge counts blocks handed out at least once; a second request of the same size reuses the first
    one's freed blocks (prefix caching off, so they hold no hash), however large the pool."""
    engine = make_engine(llama_dir, cache={"enable_prefix_caching": False})
    block_bytes = engine.layout.bytes_per_block
    assert engine.stats().kv_cache_touched_bytes == 0
    run_to_completion(engine, [_request("a", _prompts([40], seed=1)[0])])
    touched = engine.stats().kv_cache_touched_bytes
    assert touched == -(-(40 + 64) // engine.layout.block_size) * block_bytes
    run_to_completion(engine, [_request("b", _prompts([40], seed=2)[0])])
    assert engine.stats().kv_cache_touched_bytes == touched < engine.layout.num_bytes
