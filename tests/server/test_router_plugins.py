"""A third-party router plugin, installed as a package with an entry point, serving a real `tokenmill serve`:
the requests it fails to place are served all the same (routed by least_loaded), counted in /metrics by
reason and logged naming the router and its plugin; the others go where it says."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import Server, start_tiny_server

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

FAIL_TOKEN = 7  # a prompt starting with it makes the router raise
BAD_INDEX_TOKEN = 8  # ... return an index no engine has

_PLUGIN = '''
"""Routes to the first healthy engine, except for prompts whose first token its options name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import msgspec

from tokenmill import EngineCoreRequest, EngineState, Router, hookimpl


class Options(msgspec.Struct, forbid_unknown_fields=True):
    fail_token: int = -1
    bad_index_token: int = -1


class FlakyRouter(Router):
    name: ClassVar[str] = "flaky"

    def __init__(self, options: Options) -> None:
        self.options = options

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        first = request.prompt_token_ids[0]
        if first == self.options.fail_token:
            raise ValueError(f"no engine for token {first}")
        if first == self.options.bad_index_token:
            return 99
        return next(engine.index for engine in engines if engine.is_healthy)


@hookimpl
def tokenmill_plugin_options() -> type[Options]:
    return Options


@hookimpl
def tokenmill_register_routers(register) -> None:
    register("flaky", "flaky_router_plugin:FlakyRouter")
'''

_PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "flaky-router-plugin"
version = "0.0.1"

[project.entry-points.tokenmill]
flaky-router = "flaky_router_plugin"
"""


def _install_plugin(root: Path) -> Path:
    """Build and install the plugin package into a directory of its own; returns that directory."""
    source = root / "src"
    (source / "flaky_router_plugin").mkdir(parents=True)
    (source / "flaky_router_plugin" / "__init__.py").write_text(textwrap.dedent(_PLUGIN))
    (source / "pyproject.toml").write_text(textwrap.dedent(_PYPROJECT))
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    return target


@pytest.fixture(scope="module")
def flaky_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("router-plugin")
    site = _install_plugin(root)
    config = root / "tokenmill.toml"
    # The router reads which tokens to fail from its options: this also checks that options reach it.
    config.write_text(f"[plugins.flaky-router]\nfail_token = {FAIL_TOKEN}\nbad_index_token = {BAD_INDEX_TOKEN}\n")
    with pytest.MonkeyPatch.context() as patch:  # the server (and the engine it spawns) inherit it
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        server = start_tiny_server(root, tiny_model_dir, smollm2_gguf, "--config", str(config), "--router", "flaky")
    yield server
    server.stop()


def _complete(server: Server, prompt: list[int], **extra: Any) -> httpx.Response:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _fallbacks(server: Server) -> dict[str, float]:
    samples = server.metrics()
    return {
        reason: samples.get(f'tokenmill:router_fallbacks_total{{reason="{reason}",router="flaky"}}', -1.0)
        for reason in ("error", "invalid_choice")
    }


def test_requests_the_router_fails_are_served_by_least_loaded_and_counted(flaky_server: Server) -> None:
    before = _fallbacks(flaky_server)
    assert before["error"] >= 0 and before["invalid_choice"] >= 0  # exported from the start
    assert _complete(flaky_server, [1, 2, 3]).status_code == 200
    for response in (
        _complete(flaky_server, [FAIL_TOKEN, 2, 3]),
        _complete(flaky_server, [FAIL_TOKEN, 2, 3], stream=True),
        _complete(flaky_server, [BAD_INDEX_TOKEN, 2]),
    ):
        assert response.status_code == 200, response.text
    response = _complete(flaky_server, [FAIL_TOKEN, 5, 6])
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    after = _fallbacks(flaky_server)
    assert after == {"error": before["error"] + 3, "invalid_choice": before["invalid_choice"] + 1}
    log = flaky_server.log.read_text()
    assert "router 'flaky' (plugin 'flaky-router') failed for request" in log
    assert "ValueError: no engine for token 7" in log and "returned 99, not a healthy engine" in log
    assert httpx.get(f"{flaky_server.url}/health").status_code == 200


def test_failing_and_succeeding_requests_side_by_side(flaky_server: Server) -> None:
    prompts = [[FAIL_TOKEN if number % 2 else 1, number + 10] for number in range(8)]
    before = _fallbacks(flaky_server)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(
                client.post(f"{flaky_server.url}/v1/completions",
                            json={"model": flaky_server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
                for prompt in prompts
            ))  # fmt: skip

    responses = asyncio.run(run())
    for response in responses:
        assert response.status_code == 200, response.text
    assert _fallbacks(flaky_server)["error"] == before["error"] + 4
    assert flaky_server.process.poll() is None
