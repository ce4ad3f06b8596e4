"""KV tiers under a real engine: greedy output with tiers equals without, through eviction, reload and preemption;
tenant salts keep prefixes apart; a restart over a disk tier reloads what the last engine computed."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill.kv_cache import block_hashes
from tokenmill.messages import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, length: int = 40) -> list[int]:
    return [(7 * i + 13 * seed) % 500 + 3 for i in range(length)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama-tiny")
    save_hf_model("llama-tiny", directory)
    return directory


def _rounds(engine, prompts: list[list[int]], concurrent: int, salt: str | None = None) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Run the prompts ``concurrent`` at a time, in order; each request's tokens."""
    results = []
    for start in range(0, len(prompts), concurrent):
        batch = [
            EngineCoreRequest(f"r{start + i}-{salt}", prompt, PARAMS, [], float(start + i), cache_salt=salt)
            for i, prompt in enumerate(prompts[start : start + concurrent])
        ]
        tokens = run_to_completion(engine, batch)
        results += [tokens[request.request_id] for request in batch]
    return results


def test_stacked_tiers_change_no_token_through_eviction_reload_and_preemption(model_dir: Path, tmp_path: Path) -> None:
    # 4 requests of 40 + 8 tokens at once need 48 blocks of 4; the device has 30, so some are preempted, and
    # the later rounds find their prefixes evicted. The cpu tier holds 6 blocks and passes the rest to disk.
    prompts = [_prompt(seed) for seed in range(4)] * 2 + [_prompt(seed) + _prompt(9, 8) for seed in range(4)]
    cache = {"num_kv_blocks": 30}
    plain_engine = make_engine(model_dir, cache=cache)
    plain = _rounds(plain_engine, prompts, concurrent=4)
    assert plain_engine.stats().num_preemptions > 0  # the budget does force preemption

    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # layers, K/V, block size, kv heads, head dim, float32
    tiers = [
        {"name": "cpu", "capacity": f"{6 * block_bytes}B"},
        {"name": "disk", "capacity": "16MiB", "path": str(tmp_path), "write": "eviction"},
    ]
    tiered_engine = make_engine(model_dir, cache=cache, kv_tiers=tiers)  # type: ignore[arg-type]
    arch = tiered_engine.loaded.arch
    assert block_bytes == arch.num_layers * 2 * 4 * arch.num_kv_heads * arch.head_dim * 4
    tiered = _rounds(tiered_engine, prompts, concurrent=4)
    tiered_engine.close()
    assert tiered == plain
    cpu, disk = tiered_engine.kv_tiers
    assert cpu.stats.hits > 0 and disk.stats.hits > 0  # both tiers served loads
    assert disk.stats.bytes_written > 0  # what the cpu tier evicted went down to disk
    assert sum(tier.loads for tier in tiered_engine.stats().kv_tiers) > 0


def test_a_prefix_cached_for_one_tenant_is_never_loaded_for_another(model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(model_dir, cache={"num_kv_blocks": 24}, kv_tiers=[{"name": "cpu", "capacity": "16MiB"}])  # type: ignore[arg-type]
    (tier,) = engine.kv_tiers
    _rounds(engine, [_prompt(1)], 1, salt="tenant-a")
    _rounds(engine, [_prompt(seed) for seed in range(2, 6)], 1, salt="tenant-a")  # evicts the first prefix
    assert tier.stats.hits == 0
    _rounds(engine, [_prompt(1)], 1, salt="tenant-b")
    assert tier.stats.hits == 0  # same tokens, another tenant: computed, not loaded
    _rounds(engine, [_prompt(1)], 1, salt="tenant-a")
    assert tier.stats.hits > 0  # the owner loads it


def test_a_new_engine_over_the_same_disk_tier_loads_what_the_last_one_computed(model_dir: Path, tmp_path: Path) -> None:
    tiers = [{"name": "disk", "capacity": "16MiB", "path": str(tmp_path)}]
    first = make_engine(model_dir, kv_tiers=tiers)  # type: ignore[arg-type]
    expected = _rounds(first, [_prompt(3)], 1)
    first.close()  # flushes the writes ('completion': every block it computed)
    restarted = make_engine(model_dir, kv_tiers=tiers)  # type: ignore[arg-type]
    assert _rounds(restarted, [_prompt(3)], 1) == expected
    (disk,) = restarted.kv_tiers
    assert disk.stats.hits == (len(_prompt(3)) - 1) // 4  # every reusable block came from disk
    other_model = tmp_path / "other-model"
    save_hf_model("llama-tiny", other_model, seed=1)
    foreign = make_engine(other_model, kv_tiers=tiers)  # type: ignore[arg-type]
    _rounds(foreign, [_prompt(3)], 1)
    assert foreign.kv_tiers[0].stats.hits == 0  # other weights: another fingerprint, nothing shared


def test_a_decode_engine_holds_a_remote_prefill_request_until_its_blocks_arrive(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tokenmill.step_loop

    prompt = _prompt(5)
    prefill = make_engine(model_dir, kv_tiers=[{"name": "cpu", "capacity": "16MiB", "write": "completion"}])  # type: ignore[arg-type]
    (expected,) = _rounds(prefill, [prompt], 1)  # its blocks are now in the prefill engine's tier
    decode = make_engine(model_dir, kv_tiers=[{"name": "cpu", "capacity": "16MiB", "write": "none"}])  # type: ignore[arg-type]
    remote = {"do_remote_prefill": True}
    decode.add_request(EngineCoreRequest("d", prompt, PARAMS, [], 0.0, kv_transfer_params=remote))
    assert decode.only_waiting_for_kv and decode.step() == []  # held: nothing is computed yet
    source, received = prefill.kv_tiers[0], decode.kv_tiers[0]
    assert source.stats.bytes_written > 0 and received.stats.bytes_written == 0  # 'none': never written locally
    for block_hash in block_hashes(prompt, 4, decode.kv_cache_hash_salt)[: (len(prompt) - 1) // 4]:
        block = source.fetch(block_hash)
        assert block is not None
        received.store(block_hash, block)  # what the KV connector does
    assert run_to_completion(decode, [])["d"] == expected
    assert received.stats.hits == (len(prompt) - 1) // 4  # every reusable block loaded, none recomputed

    monkeypatch.setattr(tokenmill.step_loop, "KV_TRANSFER_TIMEOUT_S", 0.0)  # blocks that never come
    late = EngineCoreRequest("late", _prompt(6), PARAMS, [], 1.0, kv_transfer_params=remote)
    assert run_to_completion(decode, [late])["late"] == _rounds(prefill, [_prompt(6)], 1)[0]  # computed here

    monkeypatch.setattr(tokenmill.step_loop, "KV_TRANSFER_TIMEOUT_S", 60.0)
    decode.add_request(EngineCoreRequest("gone", _prompt(7), PARAMS, [], 2.0, kv_transfer_params=remote))
    (aborted,) = decode.abort_requests(["gone"])
    assert aborted.finish_reason == "abort" and aborted.request_finished
    assert not decode.has_unfinished_requests()


def test_a_damaged_or_vanished_disk_tier_costs_recomputation_never_a_wrong_token(
    model_dir: Path, tmp_path: Path
) -> None:
    tiers = [{"name": "disk", "capacity": "16MiB", "path": str(tmp_path / "kv")}]
    first = make_engine(model_dir, kv_tiers=tiers)  # type: ignore[arg-type]
    expected = _rounds(first, [_prompt(8), _prompt(9)], 1)
    first.close()
    files = sorted((tmp_path / "kv").rglob("*.safetensors"))
    assert len(files) >= 2 * (len(_prompt(8)) // 4)  # every prompt block of both (and some of the answers')
    for file in files:  # flip a byte near the end of each file: in the K/V payload
        data = bytearray(file.read_bytes())
        data[-3] ^= 0xFF
        file.write_bytes(bytes(data))
    restarted = make_engine(model_dir, kv_tiers=tiers)  # type: ignore[arg-type]
    (disk,) = restarted.kv_tiers
    assert _rounds(restarted, [_prompt(8)], 1) == expected[:1]  # every block failed its checksum: recomputed
    assert disk.stats.rejected > 0 and disk.stats.hits == 0
    disk.flush()  # type: ignore[attr-defined]  # (the recomputed blocks are being written back meanwhile)
    shutil.rmtree(tmp_path / "kv")  # the directory vanishes while serving
    assert _rounds(restarted, [_prompt(9)], 1) == expected[1:]
    assert disk.stats.errors > 0 and disk.stats.hits == 0
    restarted.close()


def test_while_a_prefix_is_read_from_disk_the_running_requests_keep_decoding(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(model_dir, kv_tiers=[{"name": "disk", "capacity": "16MiB", "path": str(tmp_path)}])  # type: ignore[arg-type]
    (disk,) = engine.kv_tiers
    (expected,) = _rounds(engine, [_prompt(10)], 1)
    disk.flush()  # type: ignore[attr-defined]
    assert engine.kv_cache.reset_prefix_cache()  # only the disk has the prefix now
    gate = threading.Event()
    read = disk._read  # type: ignore[attr-defined]

    def slow_read(block_hash: bytes) -> torch.Tensor | None:
        gate.wait(2)  # a slow disk: no read completes until the test says so (or 2 s pass)
        return read(block_hash)

    monkeypatch.setattr(disk, "_read", slow_read)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(EngineCoreRequest("running", _prompt(11), long, [], 0.0))
    engine.step()  # its prompt
    engine.add_request(EngineCoreRequest("from-disk", _prompt(10), PARAMS, [], 1.0))
    tokens: dict[str, list[int]] = {"running": [], "from-disk": []}
    for _ in range(5):  # the reads are stuck; the running request still gets a token every step
        outputs = {output.request_id: output.new_token_ids for output in engine.step()}
        assert len(outputs.get("running", [])) == 1 and "from-disk" not in outputs
        tokens["running"] += outputs["running"]
    gate.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens["from-disk"] == expected
    assert disk.stats.hits == (len(_prompt(10)) - 1) // 4  # loaded, not recomputed
    engine.close()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_blocks_travel_through_tiers_with_their_scales(
    model_dir: Path, tmp_path: Path, kv_cache_dtype: str
) -> None:
    """An fp8/int8 cache's blocks hold their scales (rows of head_dim + 4 codes), so tiers store and reload them
    as any block: greedy output with tiers equals the same quantized cache without."""
    prompts = [_prompt(seed) for seed in range(4)] * 2
    cache = {"num_kv_blocks": 30, "kv_cache_dtype": kv_cache_dtype}
    plain = _rounds(make_engine(model_dir, cache=cache), prompts, concurrent=4)
    tiers = [{"name": "cpu", "capacity": "64KiB"}, {"name": "disk", "capacity": "16MiB", "path": str(tmp_path)}]
    engine = make_engine(model_dir, cache=cache, kv_tiers=tiers)  # type: ignore[arg-type]
    tiered = _rounds(engine, prompts, concurrent=4)
    engine.close()
    assert tiered == plain
    cpu, disk = engine.kv_tiers
    assert cpu.stats.hits + disk.stats.hits > 0
    (block,) = engine.executor.runner.read_blocks([0])
    head_dim = engine.loaded.arch.head_dim
    assert block.dtype == engine.loaded.kv_cache_dtype and block.shape[-1] == head_dim + 4
