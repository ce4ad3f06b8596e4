"""A plugin package from outside the tree (contrib/tokenmill-example-policies), installed with pip into a
folder of its own and found through ``PYTHONPATH``, as a user's would be: it replaces the scheduling
policy, adds a logits processor and a router, receives its ``[plugins.example-policies]`` options, and
serves through a real ``tokenmill serve`` with two engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tokenmill import Tokenizer
from tokenmill.testing import TokenmillServer, install_package, pythonpath_env

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "contrib" / "tokenmill-example-policies"

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package installed (not editable) into a folder that only ``PYTHONPATH`` points at."""
    return install_package(PACKAGE, tmp_path_factory.mktemp("site"))


def test_listed_from_the_installed_copy_with_its_options(site: Path) -> None:
    env = {**os.environ, **pythonpath_env(site)}
    code = "import tokenmill_example_policies as m; print(m.__file__)"
    where = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert Path(where.stdout.strip()).is_relative_to(site)  # not the source tree, nor an editable install
    listing = subprocess.run([sys.executable, "-m", "tokenmill.cli", "plugins", "--json"],
                             capture_output=True, text=True, env=env, check=True)  # fmt: skip
    (info,) = [p for p in json.loads(listing.stdout)["plugins"] if p["name"] == "example-policies"]
    assert (info["source"], info["package"], info["error"]) == ("entry point", "tokenmill-example-policies", None)
    assert info["provides"] == {
        "logits_processor": ["banned-words"],
        "router": ["least-in-flight"],
        "scheduler": ["shortest-first"],
    }
    assert info["options"] == {"banned_token_ids": [], "prefer_lowest_index": True}


def _engine_queries(server: TokenmillServer, engine: int) -> float:
    """Prompt tokens an engine has looked up in its prefix cache: how much work it was sent."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("tokenmill:prefix_cache_queries") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_selected_by_config_and_in_effect_through_a_real_server(
    site: Path, tokenmill_server: Callable[..., TokenmillServer], tiny_model_dir: Path
) -> None:
    tokenizer = Tokenizer.from_path(tiny_model_dir)
    x_id = tokenizer.token_to_id("x")
    config = f"""
[scheduler]
policy = "shortest-first"

[sampler]
logits_processors = ["banned-words"]  # besides the built-in logit_bias and min_tokens

[server]
router = "least-in-flight"
data_parallel_size = 2

[plugins.example-policies]
banned_token_ids = {[t for t in range(tokenizer.vocab_size) if t != x_id]}
"""
    server = tokenmill_server(config=config, env=pythonpath_env(site))
    client = server.client

    # The options reached the logits processor: every token but "x" is banned.
    completion = client.completions.create(model=server.model, prompt="hello", max_tokens=5, temperature=0.8)
    assert completion.choices[0].text == "xxxxx"

    # A request that bans "x" as well leaves nothing to sample: the plugin raises, that request fails with
    # its name, and the server serves the next one.
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2, "vllm_xargs": {"banned_token_ids": [x_id]}}
    failed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert failed.status_code >= 400 and "banned-words" in failed.text, failed.text
    assert client.completions.create(model=server.model, prompt="hi", max_tokens=2).choices[0].text == "xx"

    # The engines run the plugin's scheduler: like fcfs, it refuses priorities, and says which it is.
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "vllm_xargs": None, "priority": 1}, timeout=60)
    assert refused.status_code == 400 and "'shortest-first' scheduler" in refused.text, refused.text

    # The front end routes with the plugin's router: one request at a time, all go to engine 0.
    deadline = time.monotonic() + 30
    while _engine_queries(server, 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _engine_queries(server, 0) > 0 and _engine_queries(server, 1) == 0
