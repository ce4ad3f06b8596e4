"""``bench linears``: every linear layer of a model, timed alone, for several models in one run.

The quantizers of different checkpoints of one model (a Q4_1 GGUF, its GPTQ, AWQ, FP8 or W8A8 checkpoints)
store the same shapes differently; this times each model's linears as loaded, outside the engine, so that what
differs is the storage and the matmul alone. Per model and number of input rows ``M`` (1 is a decode step of one
request, 32 of 32): the time of one pass over all linears of the body (every layer's q/k/v, o, gate/up and down),
and the output projection's apart (``compute_logits``: a quantized ``lm_head``, or the float embedding when the
checkpoint ties them), each the best of ``repeats`` passes after a warm-up. Every layer has
its own weights, so they stream from memory as in a real step. Models run one after the other: only one is loaded
at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tokenmill.config import EngineConfig


def run_linears(configs: Sequence[EngineConfig], rows: Sequence[int], repeats: int, seed: int) -> dict[str, Any]:
    """The report: one entry per config (model) with body and lm_head milliseconds per row count."""
    import gc

    import torch

    from tokenmill.layers.linear import Linear
    from tokenmill.model_loader import load_model

    models = []
    for config in configs:
        loaded = load_model(config)
        linears = [(name, module) for name, module in loaded.model.named_modules() if isinstance(module, Linear)]
        generator = torch.Generator().manual_seed(seed)
        inputs = {
            (m, k): torch.randn(m, k, generator=generator)
            for m in rows
            for k in {module.in_features for _, module in linears} | {loaded.arch.hidden_size}
        }
        body = [module for name, module in linears if not name.endswith("lm_head")]
        head = [module for name, module in linears if name.endswith("lm_head")]
        hidden_size = loaded.arch.hidden_size
        entry: dict[str, Any] = {
            "model": config.model.model,
            "quantizer": body[0].quantizer.name if body else None,
            "lm_head_quantizer": head[0].quantizer.name if head else "tied embedding (float)",
            "num_linears": len(body),
            "ms": {},
        }
        with torch.inference_mode():
            for m in rows:
                entry["ms"][str(m)] = {
                    "body": _best_ms(body, inputs, m, repeats),
                    "lm_head": _best_ms([_Head(loaded.model, hidden_size)], inputs, m, repeats),
                }
        models.append(entry)
        del loaded, linears, body, head, inputs
        gc.collect()
    baseline = models[0]
    for entry in models:
        entry["body_vs_first"] = {m: round(entry["ms"][m]["body"] / baseline["ms"][m]["body"], 3) for m in entry["ms"]}
    return {
        "benchmark": "linears",
        "parameters": {"rows": list(rows), "repeats": repeats, "seed": seed, "threads": torch.get_num_threads()},
        "models": models,
    }


class _Head:
    """The output projection as the model runs it, in the shape ``_best_ms`` times."""

    def __init__(self, model: Any, hidden_size: int) -> None:
        self.model = model
        self.in_features = hidden_size

    def __call__(self, x: Any) -> Any:
        return self.model.compute_logits(x)


def _best_ms(modules: list[Any], inputs: dict[tuple[int, int], Any], m: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms caches, allocator and thread pool
        start = time.perf_counter()
        for module in modules:
            module(inputs[(m, module.in_features)])
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 3)


def format_linears(report: dict[str, Any]) -> str:
    rows = report["parameters"]["rows"]
    header = (
        ["model", "quantizer (lm_head)"]
        + [f"M={m} body ms (x first)" for m in rows]
        + [f"M={m} lm_head ms" for m in rows]
    )
    lines = [" | ".join(header)]
    for entry in report["models"]:
        cells = [str(entry["model"]), f"{entry['quantizer']} ({entry['lm_head_quantizer']})"]
        cells += [f"{entry['ms'][str(m)]['body']:.3f} ({entry['body_vs_first'][str(m)]:.2f}x)" for m in rows]
        cells += [f"{entry['ms'][str(m)]['lm_head']:.3f}" for m in rows]
        lines.append(" | ".join(cells))
    return "\n".join(lines)
