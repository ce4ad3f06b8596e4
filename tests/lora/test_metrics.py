"""Per-adapter metrics: the engine reports the adapters of its running and waiting requests, exported as vLLM's
``lora_requests_info``; the front end counts requests and tokens by adapter."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from tests.factories import make_requests, make_scheduler
from tokenmill import LoRARequest
from tokenmill.scheduler import FCFSScheduler
from tokenmill.server.metrics import ServerMetrics


def test_engine_stats_name_the_running_and_waiting_adapters() -> None:
    scheduler = make_scheduler()
    assert isinstance(scheduler, FCFSScheduler)
    assert scheduler.stats().max_loras == 0  # without LoRA: nothing about adapters
    scheduler.max_loras = 2
    loras = [LoRARequest(f"a{i}", i, "/adapters/x") for i in (1, 2, 3)]
    for request, lora in zip(make_requests(5, prompt_len=4), [loras[0], loras[1], loras[2], loras[0], None],
                             strict=True):  # fmt: skip
        request.lora_request = lora
        scheduler.add_request(request)
    stats = scheduler.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_loras) == ([], ["a1", "a2", "a3"], 2)
    scheduler.schedule()  # a3 has no slot: it waits
    stats = scheduler.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (["a1", "a2"], ["a3"])


def test_lora_requests_info_and_per_adapter_counters() -> None:
    scheduler = make_scheduler()
    assert isinstance(scheduler, FCFSScheduler)
    scheduler.max_loras = 4
    request = make_requests(1, prompt_len=4)[0]
    request.lora_request = LoRARequest("sql", 1, "/adapters/sql")
    scheduler.add_request(request)
    scheduler.schedule()
    engines = [SimpleNamespace(index=0, stats=scheduler.stats()), SimpleNamespace(index=1, stats=None)]
    metrics = ServerMetrics(SimpleNamespace(clients=engines), "m")
    metrics.observe_lora_request("sql", 12)
    metrics.observe_lora_tokens("sql", 3)
    metrics.observe_lora_tokens("sql", 1)
    text = generate_latest(metrics.registry).decode()
    info = [line for line in text.splitlines() if line.startswith("tokenmill:lora_requests_info{")]
    assert len(info) == 1, text
    assert 'engine="0"' in info[0] and 'max_lora="4"' in info[0]
    assert 'running_lora_adapters="sql"' in info[0] and 'waiting_lora_adapters=""' in info[0]
    assert 'tokenmill:lora_requests_total{lora_name="sql",model_name="m"} 1.0' in text
    assert 'tokenmill:lora_prompt_tokens_total{lora_name="sql",model_name="m"} 12.0' in text
    assert 'tokenmill:lora_generation_tokens_total{lora_name="sql",model_name="m"} 4.0' in text
