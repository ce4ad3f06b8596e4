"""/metrics under vLLM's names: the server's metrics object, a real server's scrape, and the Grafana dashboard."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.server.conftest import Server
from tokenmill.messages import EngineStatsMessage
from tokenmill.server.metrics import ServerMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "contrib" / "grafana" / "tokenmill-dashboard.json"


def _metrics(*clients: SimpleNamespace) -> ServerMetrics:
    return ServerMetrics(SimpleNamespace(clients=list(clients)), "m")


def _client(index: int, stats: EngineStatsMessage | None = None, **extra: int) -> SimpleNamespace:
    return SimpleNamespace(index=index, stats=stats, **extra)


def _value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_every_engine_starts_with_its_series_at_zero() -> None:
    metrics = _metrics(_client(0), _client(1))
    for engine in ("0", "1"):
        for reason in ("stop", "length", "abort", "error"):
            assert _value(metrics, "tokenmill:request_success_total", engine=engine, finished_reason=reason) == 0
        assert _value(metrics, "tokenmill:time_to_first_token_seconds_count", engine=engine) == 0
        assert _value(metrics, "tokenmill:request_decode_time_seconds_count", engine=engine) == 0


def test_a_finished_request_is_counted_and_its_phases_timed() -> None:
    metrics = _metrics(_client(0), _client(1))
    # Arrived at 10, queued 0.5 s in the engine, first token at 11, last at 14, answered at 14.25.
    metrics.observe_finished(1, "length", 10.0, 0.5, 11.0, 14.0, 14.25)
    metrics.observe_unfinished(1, "abort")
    assert _value(metrics, "tokenmill:request_success_total", engine="1", finished_reason="length") == 1
    assert _value(metrics, "tokenmill:request_success_total", engine="1", finished_reason="abort") == 1
    assert _value(metrics, "tokenmill:request_success_total", engine="0", finished_reason="length") == 0
    assert _value(metrics, "tokenmill:e2e_request_latency_seconds_sum", engine="1") == 4.25
    assert _value(metrics, "tokenmill:request_prefill_time_seconds_sum", engine="1") == 0.5
    assert _value(metrics, "tokenmill:request_decode_time_seconds_sum", engine="1") == 3.0


def test_rejections_are_counted_by_code_or_status() -> None:
    metrics = _metrics(_client(0))
    metrics.observe_rejected(429, "queue_full")
    metrics.observe_rejected(429, "queue_full")
    metrics.observe_rejected(400, None)
    metrics.observe_rejected(418, None)
    metrics.observe_rejected(499, None)  # the client left: an abort, not a rejection
    rejected = "tokenmill:request_rejected_total"
    assert _value(metrics, rejected, reason="queue_full") == 2
    assert _value(metrics, rejected, reason="invalid_request") == 1
    assert _value(metrics, rejected, reason="http_418") == 1
    assert _value(metrics, rejected, reason="http_499") is None


def test_engine_state_is_read_from_heartbeats_and_restarts_from_the_client() -> None:
    stats = EngineStatsMessage(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=40,
                               prefix_cache_hits=16, num_preemptions=1, num_prompt_tokens=40,
                               num_generation_tokens=7, kv_cache_touched_bytes=6 * 2**20)  # fmt: skip
    metrics = _metrics(_client(0, stats, num_restarts=2), _client(1))  # engine 1: no heartbeat yet, no num_restarts
    assert _value(metrics, "tokenmill:num_requests_running", engine="0") == 3
    assert _value(metrics, "tokenmill:num_requests_waiting", engine="0") == 2
    assert _value(metrics, "tokenmill:kv_cache_usage_perc", engine="0") == 0.25
    assert _value(metrics, "tokenmill:kv_cache_touched_bytes", engine="0") == 6 * 2**20
    assert _value(metrics, "tokenmill:prompt_tokens_total", engine="0") == 40
    assert _value(metrics, "tokenmill:generation_tokens_total", engine="0") == 7
    assert _value(metrics, "tokenmill:prefix_cache_hits_total", engine="0") == 16
    assert _value(metrics, "tokenmill:num_preemptions_total", engine="0") == 1
    assert _value(metrics, "tokenmill:engine_restarts_total", engine="0") == 2
    assert _value(metrics, "tokenmill:engine_restarts_total", engine="1") == 0
    assert _value(metrics, "tokenmill:num_requests_running", engine="1") is None


def test_router_fallbacks_outstanding_tokens_and_summary_size_are_exported() -> None:
    stats = EngineStatsMessage(0, 0, 0.0, 0, 0, 0, 0, 0, num_outstanding_tokens=321)
    engine = SimpleNamespace(index=0, stats=stats, prefix_cache=SimpleNamespace(keys={b"a" * 8, b"b" * 8}))
    group = SimpleNamespace(clients=[engine, _client(1)], router_name="prefix_aware",
                            num_router_fallbacks={"error": 3, "invalid_choice": 1})  # fmt: skip
    metrics = ServerMetrics(group, "m")
    fallbacks = "tokenmill:router_fallbacks_total"
    assert _value(metrics, fallbacks, router="prefix_aware", reason="error") == 3
    assert _value(metrics, fallbacks, router="prefix_aware", reason="invalid_choice") == 1
    assert _value(metrics, "tokenmill:num_outstanding_tokens", engine="0") == 321
    assert _value(metrics, "tokenmill:num_outstanding_tokens", engine="1") is None  # no stats yet
    assert _value(metrics, "tokenmill:prefix_cache_summary_blocks", engine="0") == 2


# ---------------------------------------------------------------- a real server


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_real_server_exports_vllm_names_with_sensible_values(tiny_server: Server) -> None:
    length = 'tokenmill:request_success_total{finished_reason="length"}'
    not_found = 'tokenmill:request_rejected_total{reason="model_not_found"}'
    before = tiny_server.metrics()
    for _ in range(3):
        tiny_server.client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    assert httpx.post(f"{tiny_server.url}/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    deadline = time.monotonic() + 10
    while True:  # engine counters arrive with heartbeats
        after = tiny_server.metrics()
        generated = after["tokenmill:generation_tokens_total"] - before.get("tokenmill:generation_tokens_total", 0)
        if generated >= 15 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after[length] == before[length] + 3
    assert after[not_found] == before.get(not_found, 0) + 1
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time"):  # fmt: skip
        name = f"tokenmill:{histogram}_seconds_count"
        assert after[name] == before[name] + 3, name
    itl = "tokenmill:inter_token_latency_seconds_count"
    assert after[itl] >= before[itl] + 3  # at least one later delta per request
    assert generated >= 15
    assert after["tokenmill:prompt_tokens_total"] > before.get("tokenmill:prompt_tokens_total", 0)
    assert 0.0 <= after["tokenmill:kv_cache_usage_perc"] <= 1.0
    assert after["tokenmill:engine_restarts_total"] == 0
    text = httpx.get(f"{tiny_server.url}/metrics").text
    running = [line for line in text.splitlines() if line.startswith("tokenmill:num_requests_running{")]
    assert len(running) == 1 and 'model_name="tiny"' in running[0] and 'engine="0"' in running[0], running
    assert "tokenmill_" not in text and "vllm:" not in text


def _exported_names(text: str) -> set[str]:
    """Every sample name a /metrics page can have: those it has, and those its TYPE lines promise (a labelled
    counter shows none until it is first counted)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            names |= {name + suffix for suffix in suffixes.get(kind, ("",))}
    return names


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(tiny_server: Server) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    used = {name for expr in exprs for name in re.findall(r"\b\w+:\w+", expr)}
    exported = _exported_names(httpx.get(f"{tiny_server.url}/metrics").text)
    assert len(used) >= 15 and all(name.startswith("tokenmill:") for name in used), sorted(used)
    assert used <= exported, sorted(used - exported)
