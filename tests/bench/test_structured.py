"""``bench structured``: its schemas, its checker (``jsonschema``), and every part against a real `tokenmill serve`
(a tiny random model at temperature 1.0, which writes bytes at random unless masked), where a server that ignores
the constraint is caught."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.schemas import SCHEMAS, TOOLS
from tokenmill_plugins.commands.bench.structured import LONG_SCHEMA, check_reply, fifty_properties

from tests.bench.fake_server import FakeServerState, serve_fake
from tests.server.conftest import Server, start_server
from tokenmill.testing import save_tiny_model


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_schema_is_valid_and_compiles(name: str) -> None:
    schema = SCHEMAS[name]
    jsonschema.Draft202012Validator.check_schema(schema)
    llguidance.LLMatcher.grammar_from_json_schema(schema)  # raises on a schema llguidance cannot take


def test_at_least_twenty_schemas_and_bounded_tools() -> None:
    assert len(SCHEMAS) >= 20
    for schema in [*(tool["function"]["parameters"] for tool in TOOLS), LONG_SCHEMA, fifty_properties("x")]:
        jsonschema.Draft202012Validator.check_schema(schema)
    assert len(fifty_properties("x")["properties"]) == 50
    assert fifty_properties("a")["properties"].keys().isdisjoint(fifty_properties("b")["properties"])


def test_check_reply_catches_what_breaks_the_schema() -> None:
    schema = SCHEMAS["person"]
    assert check_reply('{"name": "Ann", "age": 30, "email": "a@b.c"}', schema) is None
    assert check_reply('{"name": "Ann", "age": 300, "email": "a@b.c"}', schema) == (
        "invalid: 300 is greater than the maximum of 120"
    )
    assert (check_reply('{"name": "Ann", "age": 3', schema) or "").startswith("not JSON")
    assert (check_reply(None, schema) or "").startswith("not JSON")
    assert (check_reply('{"name": "Ann", "age": 3, "email": "", "x": 1}', schema) or "").startswith("invalid")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("bench-structured") / "llama")
    server = start_server(
        tmp_path_factory.mktemp("bench-structured-server"), str(model_dir), "--served-model-name", "tiny",
        "--structured-outputs-config", '{"disable_any_whitespace": true}', model_name="tiny",
    )  # fmt: skip
    yield server
    server.stop()


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    path = tmp_path / "report.json"
    result = CliRunner().invoke(bench, ["structured", *args, "--output-json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(path.read_text())
    return report


@pytest.mark.multiproc
@pytest.mark.slow
def test_every_part_against_a_real_server(server: Server, tmp_path: Path) -> None:
    report = _bench(
        tmp_path,
        *("--url", server.url, "--num-requests", "48", "--num-tool-requests", "12", "--max-tokens", "400"),
        *("--overhead-concurrency", "1,4", "--rounds", "1", "--input-len", "8", "--output-len", "8"),
        "--ttft-repeats", "2",
    )  # fmt: skip
    results = report["results"]
    validity, tools = results["validity"], results["tools"]
    assert validity["failed"] == 0 and validity["valid"] + validity["invalid"] == 48
    assert validity["valid"] == 48 - validity["truncated"], validity["examples"]
    assert sum(counts["valid"] for counts in validity["per_schema"].values()) == validity["valid"]
    assert tools["failed"] == 0 and tools["invalid_calls"] == 0 and tools["without_calls"] == 0, tools["examples"]
    assert tools["valid_calls"] >= 12 - tools["truncated"] > 0
    for concurrency in ("1", "4"):
        overhead = results["overhead"][concurrency]
        assert overhead["throughput_ratio"] > 0 and overhead["itl_p50_ratio"] > 0
        assert len(overhead["runs"]["constrained"]) == len(overhead["runs"]["unconstrained"]) == 1
    ttft = results["ttft"]
    assert len(ttft["new_ttft_ms"]) == len(ttft["warm_ttft_ms"]) == 2 and min(ttft["warm_ttft_ms"]) > 0


def test_a_server_that_ignores_the_schema_is_caught(tmp_path: Path) -> None:
    """Planted: a server that answers every request with free text, whatever its schema or tools ask."""
    state = FakeServerState(inject_failures=False)
    with serve_fake(state) as url:
        results = _bench(tmp_path, "--url", url, "--parts", "validity,tools", "--num-requests", "24",
                         "--num-tool-requests", "6", "--max-tokens", "4")["results"]  # fmt: skip
    assert (results["validity"]["valid"], results["validity"]["invalid"]) == (0, 24)
    assert (results["tools"]["valid_calls"], results["tools"]["without_calls"]) == (0, 6)
    bodies = [body for body in state.bodies if "response_format" in body]
    assert {body["response_format"]["json_schema"]["name"] for body in bodies} == set(SCHEMAS)
    assert all(body["temperature"] == 1.0 for body in state.bodies)
