"""``tokenmill bench isa``: the ISA levels and the variant each kernel runs at each, ``TOKENMILL_CPU_ISA``, the
``--isa`` errors, llama-server's command line and start-up (a fake executable), and one short run on a tiny
random GGUF against real ``tokenmill serve`` subprocesses and the fake llama-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from tokenmill_kernels.cpu_isa import ISA_LEVEL_ENV, ISA_LEVELS, apply_level_from_env, variant_for_level
from tokenmill_plugins.commands.bench import isa as isa_bench
from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.isa import (
    CPU_FLAGS,
    IsaBenchError,
    check_levels,
    cpu_info,
    format_isa,
    llama_server,
    llama_server_flags,
    supported_levels,
    variants_at,
)

from tests.factories import make_hf_model

REPO = Path(__file__).resolve().parents[2]
ALL = ["avx2", "avx_vnni", "avx512", "avx512_vnni16"]  # the int4 matmul's variants on an AVX-512 VNNI CPU
WIDE = ["avx2", "avx512"]  # paged attention's and the dense matmul's


@pytest.mark.parametrize(
    ("supported", "expected"),
    [
        (ALL, [*ALL, "avx512_vnni16"]),
        (WIDE, ["avx2", "avx2", "avx512", "avx512", "avx512"]),  # AVX-VNNI without AVX-512 runs their AVX2 variant
        (["avx2", "avx512", "avx512_vnni16"], ["avx2", "avx2", "avx512", *["avx512_vnni16"] * 2]),  # Cascade Lake
        (["avx2", "avx_vnni"], ["avx2", "avx_vnni", "avx_vnni", "avx_vnni", "avx_vnni"]),  # Alder Lake's
        ([*ALL, "amx"], [*ALL, "amx"]),  # Sapphire Rapids' matmul
        (["avx2", "sme"], ["avx2"] * 5),  # a variant of no level runs only as the best (auto)
    ],
)
def test_each_level_runs_the_best_variant_at_or_below_it(supported: list[str], expected: list[str]) -> None:
    assert [variant_for_level(supported, level) for level in ISA_LEVELS] == expected


def test_an_unknown_level_names_the_known_ones() -> None:
    with pytest.raises(ValueError) as raised:
        variant_for_level(ALL, "sse4")
    expected = "TOKENMILL_CPU_ISA='sse4' is invalid: expected auto or one of avx2, avx_vnni, avx512, avx512_vnni16, amx"
    assert str(raised.value) == expected


class _FakeKernel:
    """A loaded extension or launcher with variants: ``supported_isas``, ``isa``, ``set_isa``."""

    def __init__(self, supported: list[str]) -> None:
        self.supported = supported
        self.current = supported[-1]

    def supported_isas(self) -> list[str]:
        return self.supported

    def isa(self) -> str:
        return self.current

    def set_isa(self, name: str) -> None:
        assert name in self.supported
        self.current = name


@pytest.mark.parametrize(("value", "expected"), [(None, "avx512"), ("auto", "avx512"), ("AVX2 ", "avx2")])
def test_the_env_variable_sets_the_level_as_an_extension_loads(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: str
) -> None:
    if value is None:
        monkeypatch.delenv(ISA_LEVEL_ENV, raising=False)
    else:
        monkeypatch.setenv(ISA_LEVEL_ENV, value)
    kernel = _FakeKernel(WIDE)
    apply_level_from_env(kernel)  # type: ignore[arg-type]
    assert kernel.isa() == expected
    apply_level_from_env(SimpleNamespace())  # type: ignore[arg-type]  # an extension without variants: untouched
    monkeypatch.setenv(ISA_LEVEL_ENV, "sse4")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_ISA='sse4' is invalid"):
        apply_level_from_env(kernel)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_process_started_with_the_variable_runs_its_level() -> None:
    """The real extensions, in a fresh process (builds them on a first run)."""
    from tokenmill_kernels.quant_matmul import cpu as quant_matmul

    if not quant_matmul.is_available():
        pytest.skip("needs AVX2+FMA and a C++ toolchain")
    script = (
        "from tokenmill_kernels.dense_matmul import cpu as d\n"
        "from tokenmill_kernels.paged_attention import cpu as p\n"
        "from tokenmill_kernels.quant_matmul import cpu as q\n"
        "print(q.isa(), p.isa(), d.isa())\n"
    )
    environment = {**os.environ, ISA_LEVEL_ENV: "avx2"}
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["avx2", "avx2", "avx2"]


def test_the_levels_are_the_union_of_the_kernels_variants() -> None:
    cascade_lake = _FakeKernel(["avx2", "avx512", "avx512_vnni16"])
    launchers: Any = {"quant_matmul": cascade_lake, "dense_matmul": _FakeKernel(WIDE)}
    assert supported_levels(launchers) == ["avx2", "avx512", "avx512_vnni16"]
    assert variants_at("avx512", launchers) == {"quant_matmul": "avx512", "dense_matmul": "avx512"}
    assert check_levels(None, ["avx2", "avx512"]) == ("avx2", "avx512")
    assert check_levels(["avx512", "avx2", "avx512"], ["avx2", "avx512"]) == ("avx512", "avx2")
    with pytest.raises(IsaBenchError, match=r"^'avx_vnni' is not a level this CPU's kernels support \(avx2, avx512\)$"):
        check_levels(["avx_vnni"], ["avx2", "avx512"])
    with pytest.raises(IsaBenchError, match="no CPU kernel with variants can run here"):
        check_levels(None, [])


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("sse4", "Invalid value for '--isa': 'sse4': give one or more of avx2, avx_vnni, avx512, avx512_vnni16, "
                 "amx, comma-separated"),
        ("avx2,avx512", "Invalid value for '--isa': 'avx512' is not a level this CPU's kernels support (avx2)"),
    ],
)  # fmt: skip
def test_an_unsupported_isa_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, flag: str, message: str) -> None:
    """Checked before any model loads: on this fake CPU the kernels have AVX2 variants only."""
    monkeypatch.setattr(isa_bench, "kernel_launchers", lambda: {"quant_matmul": _FakeKernel(["avx2"])})
    result = CliRunner().invoke(bench, ["isa", "--isa", flag])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == f"Error: {message}"


def test_cpu_info_reads_the_first_cpus_model_name_and_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Some CPU @ 2.00GHz\n"
        "flags\t\t: fpu avx2 avx512f avx512_vnni\n\n"
        "processor\t: 1\nmodel name\t: Another\nflags\t\t: avx_vnni\n"
    )
    info = cpu_info(cpuinfo)
    assert info == {
        "model_name": "Some CPU @ 2.00GHz",
        "family": "6",
        "model": "207",
        "flags": {"avx2": True, "avx_vnni": False, "avx512f": True, "avx512_vnni": True},
    }
    missing = {"model_name": None, "family": None, "model": None, "flags": dict.fromkeys(CPU_FLAGS, False)}
    assert cpu_info(tmp_path / "missing") == missing


def test_the_server_alone_starts_with_the_level_in_its_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[str | None] = []

    class _Server:
        url = "http://127.0.0.1:1"

        def check_alive(self, during: str) -> None:
            pass

        def stop(self) -> int:
            return 0

    def start(config: object, work_dir: Path, *, timeout_s: float) -> _Server:
        seen.append(os.environ.get(ISA_LEVEL_ENV))
        return _Server()

    monkeypatch.setattr(isa_bench, "start_local_server", start)
    monkeypatch.setenv(ISA_LEVEL_ENV, "auto")
    with isa_bench._tokenmill_server(object(), tmp_path, "avx_vnni", 1.0) as url:  # type: ignore[arg-type]
        assert os.environ[ISA_LEVEL_ENV] == "auto"  # this process's own setting is back
    assert (seen, url) == (["avx_vnni"], "http://127.0.0.1:1")


# ------------------------------------------------------------------ llama-server, faked

_FAKE_LLAMA_SERVER = """#!{python}
# A stand-in for llama-server: records its arguments, serves the fake OpenAI endpoints and /health on --port.
import json, sys
sys.path.insert(0, {root!r})
import uvicorn
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.bench.fake_server import FakeServerState, make_app

with open({log!r}, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
app = make_app(FakeServerState(inject_failures=False))
async def health(request):
    return JSONResponse({{"status": "ok"}})
app.router.routes.append(Route("/health", health))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[sys.argv.index("--port") + 1]), log_level="warning")
"""


def _fake_llama_server(directory: Path) -> tuple[Path, Path]:
    """An executable fake llama-server and the file it appends its arguments to, one line per start."""
    binary, log = directory / "llama-server", directory / "llama-server-args.jsonl"
    binary.write_text(_FAKE_LLAMA_SERVER.format(python=sys.executable, root=str(REPO), log=str(log)))
    binary.chmod(0o755)
    return binary, log


def test_llama_server_gets_the_model_the_slots_and_the_threads(tmp_path: Path) -> None:
    flags = llama_server_flags(num_threads=3, num_slots=32, slot_context=320)
    assert flags == ["-np", "32", "-cb", "-c", "10240", "-t", "3", "-tb", "3"]
    binary, log = _fake_llama_server(tmp_path)
    model = tmp_path / "model.gguf"
    with llama_server(binary, model, flags, tmp_path, timeout_s=30) as url:
        port = url.rsplit(":", 1)[1]
        (arguments,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert arguments == ["-m", str(model), "--host", "127.0.0.1", "--port", port, *flags]
    assert list(tmp_path.glob("llama-server-*.log"))  # its output, kept beside the report's work


def test_a_llama_server_that_exits_is_a_one_line_error(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho loading\necho 'error: failed to load model' >&2\nexit 1\n")
    binary.chmod(0o755)
    with pytest.raises(IsaBenchError) as raised:
        with llama_server(binary, tmp_path / "m.gguf", [], tmp_path, timeout_s=30):
            pass
    assert str(raised.value) == "llama-server exited with status 1: error: failed to load model"


# ------------------------------------------------------------------ one short run


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama as a GGUF file, with the default model's vocabulary size so its tokenizer fits."""
    from tests.weights.gguf_util import write_llama_gguf

    model = make_hf_model("llama-tiny", 0, vocab_size=49152)
    return write_llama_gguf(model, model.config, tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_short_run_reports_every_round_and_the_medians(tiny_gguf: Path, smollm2_gguf: Path, tmp_path: Path) -> None:
    binary, log = _fake_llama_server(tmp_path)
    path = tmp_path / "isa.json"
    result = CliRunner().invoke(
        bench,
        [
            "isa", "--model", str(tiny_gguf), "--tokenizer", str(smollm2_gguf), "--device", "cpu",
            "--num-threads", "1", "--num-kv-blocks", "256", "--isa", "avx2", "--repeats", "2",
            "--batch-size", "2", "--context-len", "8", "--num-steps", "2", "--concurrency", "1,2",
            "--input-len", "8", "--output-len", "4", "--num-requests", "2", "--llama-server", str(binary),
            "--no-progress", "--output-json", str(path),
        ],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    results, parameters = report["results"], report["parameters"]
    assert report["benchmark"] == "isa" and parameters["levels"] == ["avx2"] and parameters["repeats"] == 2
    assert parameters["model"] == "tiny.gguf" and parameters["num_requests"] == {"1": 2, "2": 2}
    assert set(results["cpu"]["flags"]) == set(CPU_FLAGS) and results["torch_threads"] == 1
    assert len(results["git"]["commit"]) == 40

    (variant,) = results["variants"]
    assert variant["isa"] == "avx2" and set(variant["kernels"].values()) == {"avx2"}
    assert len(variant["runs"]) == 2
    for run in variant["runs"]:
        assert run["step"]["2"]["batch_size"] == 2 and run["step"]["2"]["step_ms"] > 0
        assert {level: figures["num_completed"] for level, figures in run["decode"].items()} == {"1": 2, "2": 2}
    steps = sorted(run["step"]["2"]["step_ms"] for run in variant["runs"])
    assert variant["median"]["step"]["2"]["step_ms"] == pytest.approx(sum(steps) / 2)

    llama = results["llama_server"]
    assert llama["flags"] == ["-np", "2", "-cb", "-c", str(2 * (8 + 4 + 64)), "-t", "1", "-tb", "1"]
    assert len(llama["runs"]) == 2 and len(log.read_text().splitlines()) == 2  # a fresh server each round
    for level in ("1", "2"):
        tm, ll = variant["median"]["decode"][level], llama["median"]["decode"][level]
        speedup = variant["speedup_vs_llama_server"][level]
        assert speedup["itl_p50"] == pytest.approx(ll["itl_p50_ms"] / tm["itl_p50_ms"])
        assert speedup["output_throughput"] == pytest.approx(tm["output_throughput"] / ll["output_throughput"])

    # The markdown: the CPU as heading, a row for the level and one for llama-server, as many cells as columns.
    table = result.stdout.split("\n\n")
    assert table[0].startswith("### CPU: ") and result.stdout.strip() == format_isa(report)
    header, rule, *rows = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert header.count("|") == rule.count("|") == 10 and [row.count("|") for row in rows] == [10, 10]
    assert rows[0].startswith("| `avx2` | quant avx2, attention avx2, dense avx2 |")
    assert rows[1].startswith("| llama-server | - | - |")
