"""The plugin's own tests, with tokenmill's test kit: run them once the package is installed
(``pip install -e .``); the kit's pytest fixtures load by themselves.

The server tests go through real ``tokenmill serve`` processes on a tiny random model with its own
tokenizer: the config file selects the three policies and sets the plugin's options.
"""

import asyncio
import subprocess
import threading
import time

import httpx
import pytest
from tokenmill_example_policies.banned_words import BannedWordsLogitsProcessor
from tokenmill_example_policies.options import ExamplePoliciesOptions
from tokenmill_example_policies.router import LeastInFlightRouter
from tokenmill_example_policies.scheduler import ShortestFirstScheduler

from tokenmill import PluginError, SamplingParams, Tokenizer
from tokenmill.plugin_manager import Slot
from tokenmill.testing import check_logits_processor, check_router, check_scheduler, save_tiny_model

# ---------------------------------------------------------------- the contracts, without a model


def test_scheduler_conforms():
    check_scheduler(ShortestFirstScheduler)


def test_logits_processor_conforms_per_request_and_from_its_options():
    check_logits_processor(BannedWordsLogitsProcessor, SamplingParams(extra_args={"banned_token_ids": [3, 5]}))
    processor = BannedWordsLogitsProcessor(options=ExamplePoliciesOptions(banned_token_ids=[7]))
    check_logits_processor(processor, SamplingParams(), inactive_params=None)  # its options ban for everyone


def test_router_conforms_with_either_tie_break():
    check_router(LeastInFlightRouter)
    check_router(LeastInFlightRouter(options=ExamplePoliciesOptions(prefer_lowest_index=False)))


def test_listed_by_tokenmill_plugins_with_its_options():
    listing = subprocess.run(["tokenmill", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "example-policies 0.1.0 (entry point, package tokenmill-example-policies)" in listing
    for line in ("scheduler: shortest-first", "logits_processor: banned-words", "router: least-in-flight"):
        assert line in listing
    assert "options [plugins.example-policies]: banned_token_ids = [], prefer_lowest_index = true" in listing


def test_options_are_validated_and_delivered(plugin_manager):
    system = plugin_manager(autoload=True)
    system.configure({"example-policies": {"banned_token_ids": [1, 2]}})
    processor = system.create(Slot.LOGITS_PROCESSOR, "banned-words")
    assert processor.banned_token_ids == [1, 2]
    with pytest.raises(PluginError, match="unknown option 'banned_ids'; allowed: banned_token_ids, prefer_lowest"):
        system.configure({"example-policies": {"banned_ids": [1]}})


# ---------------------------------------------------------------- through a real server


def _config(tokenizer: Tokenizer, *, router: str = "round-robin", engines: int = 1) -> str:
    """Select the three policies; the options ban every token but "x" and "y", so any greedy text is made of
    those two letters, and a request that bans one of them gets only the other."""
    allowed = {tokenizer.token_to_id("x"), tokenizer.token_to_id("y")}
    banned = [t for t in range(tokenizer.vocab_size) if t not in allowed]
    return f"""
[scheduler]
policy = "shortest-first"
max_num_seqs = 1

[sampler]
logits_processors = ["banned-words"]  # besides the built-in logit_bias and min_tokens

[server]
router = "{router}"
data_parallel_size = {engines}

[plugins.example-policies]
banned_token_ids = {banned}
"""


@pytest.fixture
def tokenizer(tiny_model_dir):
    return Tokenizer.from_path(tiny_model_dir)


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """The kit's tiny model with a 64k context, so one request can keep the engine busy for seconds."""
    return save_tiny_model(tmp_path_factory.mktemp("long-context"), max_position_embeddings=65536)


def _metric(server, name, engine):
    """The sample of ``name`` (a counter's ``_total`` too) for one engine; 0 before the engine reports."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith((f"{name}{{", f"{name}_total{{")) and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_for(condition, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_options_reach_the_processor_and_the_scheduler_runs_shortest_first(
    tokenmill_server, tokenizer, long_context_model
):
    server = tokenmill_server(model=long_context_model, config=_config(tokenizer))
    x_id, y_id = tokenizer.token_to_id("x"), tokenizer.token_to_id("y")

    def complete(prompt, **extra):
        return server.client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0,
                                                **extra)  # fmt: skip

    text = complete("hello").choices[0].text
    assert len(text) == 6 and set(text) <= {"x", "y"}, text  # the options' bans hold
    assert complete("hello", extra_body={"vllm_xargs": {"banned_token_ids": [x_id]}}).choices[0].text == "y" * 6
    assert complete("hello", extra_body={"vllm_xargs": {"banned_token_ids": [y_id]}}).choices[0].text == "x" * 6

    # One request runs at a time (max_num_seqs = 1). While a long one runs, a 200-token prompt and then a
    # 3-token prompt queue up; when it ends, shortest-first runs the short prompt first (fcfs would not).
    finished = []
    stop = threading.Event()

    def blocker():
        body = {"model": server.model, "prompt": "a", "max_tokens": 60000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
            for _ in stream.iter_lines():
                if stop.is_set():
                    break  # leaving the stream disconnects, which aborts the request

    def send(name, prompt):
        server.client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
        finished.append(name)

    threads = [threading.Thread(target=blocker)]
    threads[0].start()
    _wait_for(lambda: _metric(server, "tokenmill:num_requests_running", 0) == 1, "the long request to run")
    for name, prompt, num_waiting in (("long", [5] * 200, 1), ("short", [6, 7, 8], 2)):
        threads.append(threading.Thread(target=send, args=(name, prompt)))
        threads[-1].start()
        _wait_for(lambda n=num_waiting: _metric(server, "tokenmill:num_requests_waiting", 0) == n, f"{name} to queue")
    stop.set()
    for thread in threads:
        thread.join(60)
    assert finished == ["short", "long"]


@pytest.mark.slow
def test_router_sends_each_request_to_the_engine_with_the_fewest_in_flight(tokenmill_server, tokenizer):
    server = tokenmill_server(config=_config(tokenizer, router="least-in-flight", engines=2))
    queries = "tokenmill:prefix_cache_queries"  # prompt tokens each engine looked up: its share of the work
    for _ in range(3):  # one at a time: nothing is in flight, so the tie goes to engine 0 every time
        server.client.completions.create(model=server.model, prompt="hello", max_tokens=2, temperature=0)
    _wait_for(lambda: _metric(server, queries, 0) > 0, "engine 0's stats")
    assert _metric(server, queries, 1) == 0  # round-robin would have sent one of the three there

    async def two_at_once():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            # The first runs long (900 tokens, EOS ignored) so it is surely in flight when the second is routed.
            long = {"model": server.model, "prompt": "hello", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
            first = asyncio.create_task(client.post("/v1/completions", json=long))
            deadline = time.monotonic() + 30
            while _metric(server, "tokenmill:num_requests_running", 0) < 1:  # engine 0 has it
                assert time.monotonic() < deadline, "the first request never ran on engine 0"
                await asyncio.sleep(0.02)
            short = {"model": server.model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
            second = await client.post("/v1/completions", json=short)
            assert second.status_code == (await first).status_code == 200

    asyncio.run(two_at_once())
    _wait_for(lambda: _metric(server, queries, 1) > 0, "engine 1 to get the second request")
