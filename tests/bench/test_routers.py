"""``tokenmill bench routers``: the multi-tenant workload, the KV budget it sets, the report, and a short run of
two routers behind real two-engine servers on a tiny model."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.routers import (
    RouterBenchOptions,
    _comparisons,
    format_routers,
    shared_prefix_kv_blocks,
)
from tokenmill_plugins.commands.bench.workload import MIN_TOKEN_ID, multi_tenant_prompts


def test_multi_tenant_prompts_share_their_tenants_system_prompt_and_interleave() -> None:
    prompts, tenants = multi_tenant_prompts(400, 4, 32, (2, 5), seed=3)
    assert (prompts, tenants) == multi_tenant_prompts(400, 4, 32, (2, 5), seed=3)
    assert multi_tenant_prompts(400, 4, 32, (2, 5), seed=4)[0] != prompts
    system = {}
    for prompt, tenant in zip(prompts, tenants, strict=True):
        assert 32 + 2 <= len(prompt) <= 32 + 5 and min(prompt) >= MIN_TOKEN_ID
        assert system.setdefault(tenant, prompt[:32]) == prompt[:32]
    assert len({tuple(p) for p in system.values()}) == 4  # each tenant its own system prompt
    assert len({tuple(p[32:]) for p in prompts}) > 390  # suffixes distinct (bar a few chance repeats)
    assert min(Counter(tenants).values()) > 70  # every tenant gets its share
    switches = sum(a != b for a, b in zip(tenants, tenants[1:], strict=False))
    assert switches > 250  # interleaved, not in runs
    with pytest.raises(ValueError, match="suffix"):
        multi_tenant_prompts(4, 2, 8, (5, 2), seed=0)


def test_the_shared_prefix_kv_budget_holds_a_share_of_the_system_prompts() -> None:
    options = RouterBenchOptions(num_tenants=8, system_prompt_len=1024, suffix_lens=(16, 64), output_len=64,
                                 concurrency=16, kv_fraction=0.6)  # fmt: skip
    # 0.6 x 8 x 1024 tokens = 308 blocks of 16, plus 16 running requests x (128 tokens = 8 blocks + 1).
    assert shared_prefix_kv_blocks(options, 16) == 308 + 16 * 9
    tiny = RouterBenchOptions(num_tenants=1, system_prompt_len=1024, kv_fraction=0.1, concurrency=1)
    assert shared_prefix_kv_blocks(tiny, 16) == (1024 + 64 + 64) // 16 + 1  # at least one whole request


def _run(workload: str, router: str, hit_rate: float, p50: float, p99: float) -> dict[str, object]:
    return {"workload": workload, "router": router, "prefix_cache_hit_rate": hit_rate, "ttft_p50_ms": p50,
            "ttft_p99_ms": p99, "e2e_p50_ms": 1.0, "output_throughput": 1.0, "requests_per_engine": {"0": 3, "1": 2},
            "num_failed": 0, "router_fallbacks": 0}  # fmt: skip


def test_ratios_are_to_round_robin_on_the_same_workload() -> None:
    runs = [_run("shared-prefix", "round_robin", 0.4, 100, 300), _run("shared-prefix", "prefix_aware", 0.8, 60, 240),
            _run("mixed", "round_robin", 0.0, 50, 400), _run("mixed", "least_loaded", 0.0, 50, 200)]  # fmt: skip
    rows = _comparisons(runs)  # type: ignore[arg-type]
    assert rows == [
        {"workload": "shared-prefix", "router": "prefix_aware", "hit_rate_vs_round_robin": 2.0,
         "ttft_p50_vs_round_robin": 0.6, "ttft_p99_vs_round_robin": 0.8},
        {"workload": "mixed", "router": "least_loaded", "hit_rate_vs_round_robin": None,
         "ttft_p50_vs_round_robin": 1.0, "ttft_p99_vs_round_robin": 0.5},
    ]  # fmt: skip
    table = format_routers({"results": {"runs": runs, "comparisons": rows}})
    assert "| shared-prefix | prefix_aware | 80.0% | 60 | 240 | 1.0 | 1.0 | 3/2 | 0 | 0 |" in table
    assert "| mixed | least_loaded | n/a | 1.0x | 0.5x |" in table


def test_an_unknown_router_fails_before_any_server_starts() -> None:
    result = CliRunner().invoke(bench, ["routers", "--routers", "round_robin,nope"])
    assert result.exit_code != 0 and "unknown router 'nope'" in result.output


@pytest.mark.slow
@pytest.mark.multiproc
def test_prefix_aware_beats_round_robin_on_the_shared_prefix_workload(tmp_path: Path, smollm2_gguf: Path) -> None:
    from tokenmill_plugins.commands.bench.routers import run_routers

    from tests.factories import save_hf_model
    from tokenmill.config import load_config

    save_hf_model("llama-tiny", tmp_path / "model", vocab_size=49152)
    config = load_config(overrides={
        "model": {"model": str(tmp_path / "model"), "tokenizer": str(smollm2_gguf)}, "device": {"device": "cpu"},
    })  # fmt: skip
    options = RouterBenchOptions(routers=("round_robin", "prefix_aware"), workloads=("shared-prefix",),
                                 num_requests=32, concurrency=4, num_tenants=4, system_prompt_len=256,
                                 suffix_lens=(8, 16), output_len=4, show_progress=False)  # fmt: skip
    report = run_routers(config, options)
    round_robin, prefix_aware = report["results"]["runs"]
    for run in (round_robin, prefix_aware):
        assert run["num_failed"] == 0 and run["router_fallbacks"] == 0 and run["data_parallel_size"] == 2
        assert sum(run["requests_per_engine"].values()) == 32 and len(run["requests_per_engine"]) == 2
        assert run["kv_blocks_per_engine"] == shared_prefix_kv_blocks(options, 16)
    assert prefix_aware["prefix_cache_hit_rate"] > round_robin["prefix_cache_hit_rate"] > 0
    (row,) = report["results"]["comparisons"]
    assert row["router"] == "prefix_aware" and row["hit_rate_vs_round_robin"] > 1
