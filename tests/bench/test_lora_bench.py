"""``bench lora-adapters`` writes adapters PEFT reads; ``bench lora`` runs both parts against a real
`tokenmill serve` that serves them (and loads one at run time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.lora import TARGET_MODULES, make_adapters, time_lost

from tests.server.conftest import start_server
from tokenmill.testing import save_tiny_model

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bench-lora") / "llama")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_adapters(model_dir, tmp_path_factory.mktemp("bench-lora-adapters"), count=3, rank=4, seed=7)


def test_adapters_are_peft_adapters_with_random_matrices(adapters: list[Path]) -> None:
    from peft import PeftConfig
    from safetensors.torch import load_file

    for path in adapters:
        config = PeftConfig.from_pretrained(str(path))
        assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 8, set(TARGET_MODULES))
        tensors = load_file(path / "adapter_model.safetensors")
        lora_b = [t for name, t in tensors.items() if "lora_B" in name]
        assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # a zero B would leave the model unchanged
    first, second = (load_file(p / "adapter_model.safetensors") for p in adapters[:2])
    assert any(not first[name].equal(second[name]) for name in first)


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    path = tmp_path / "report.json"
    result = CliRunner().invoke(bench, ["lora", *args, "--output-json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(path.read_text())
    return report


@pytest.mark.multiproc
def test_both_parts_against_a_real_server(model_dir: Path, adapters: list[Path], tmp_path: Path) -> None:
    served = [arg for i, path in enumerate(adapters[:2]) for arg in ("--lora-modules", f"a{i}={path}")]
    server = start_server(
        tmp_path, str(model_dir), "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "4", "--allow-runtime-lora-updating", *served, model_name="tiny",
    )  # fmt: skip
    try:
        report = _bench(
            tmp_path,
            *("--url", server.url, "--concurrency", "1,3", "--rounds", "1", "--input-len", "8", "--output-len", "8"),
            *("--load-adapter", str(adapters[2]), "--stall-streams", "2"),
        )
        refused = CliRunner().invoke(bench, ["lora", "--url", server.url, "--adapters", "nope", "--parts", "overhead"])
        assert refused.exit_code == 1 and "adapters nope are not served; served: a0, a1" in refused.output
    finally:
        server.stop()
    assert report["parameters"]["adapters"] == ["a0", "a1"] and report["parameters"]["model"] == "tiny"
    for concurrency in ("1", "3"):
        overhead = report["results"]["overhead"][concurrency]
        assert overhead["throughput_ratio"] > 0 and overhead["itl_p50_ratio"] > 0
    stall = report["results"]["stall"]
    assert stall["load_ms"] > 0 and stall["itl_p50_ms"] > 0 and stall["max_gap_base_join_ms"] > 0
    assert stall["extra_gap_in_steps"] == pytest.approx(
        (stall["max_gap_load_join_ms"] - stall["max_gap_adapter_join_ms"]) / stall["itl_p50_ms"]
    )
    assert stall["extra_lost_in_steps"] == pytest.approx(
        (stall["lost_load_join_ms"] - stall["lost_adapter_join_ms"]) / stall["itl_p50_ms"]
    )


def test_time_lost_counts_every_late_step_in_the_window() -> None:
    # Streams at 10 ms a token; in the window [0.1, 0.2] the first waits 30 ms once and 12 ms twice, the second
    # 25 ms once. Gaps outside the window, however long, do not count.
    first = [(0.05, 0.06), (0.09, 0.12), (0.12, 0.132), (0.132, 0.144), (0.3, 0.4)]
    second = [(0.08, 0.09), (0.1, 0.125), (0.125, 0.135), (0.25, 0.5)]
    lost = time_lost([first, second], 0.01, (0.1, 0.2))
    assert lost == pytest.approx(((0.02 + 0.002 + 0.002) + 0.015) / 2)
