"""Micro-benchmark: all linears of one SmolLM2-135M forward, float32 vs the int8 and int4 kernels.

``python -m tokenmill_kernels.quant_matmul.bench [--m 1 2 4] [--threads N] [--repeats R] [--isas avx512 ...]``

Per layer: q 576->576, k 576->192, v 576->192, o 576->576, gate/up 576->1536, down 1536->576, times 30 layers,
plus the tied 576->49152 lm_head. Every layer has its own weights, so they stream from memory as in a real
decode step rather than staying in cache. Prints milliseconds per forward (best of the repeats) for float32
``F.linear``, all-int8, all-int4, and "gguf" (int4 layers with an int8 lm_head, as stored in the default
model's Q4_1 GGUF); the batch size M at which float32 catches up decides when to fall back to dense weights.
With ``--isas``, the "gguf" forward instead, once per kernel variant named (``cpu.supported_isas()``), the
variants taking turns within each row so that they see the same machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenmill_kernels.quant_matmul import cpu, reference

HIDDEN = 576
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [N, K]
LAYERS = 30
LM_HEAD = (49152, 576)

Linear = Callable[[Tensor], Tensor]


def _bind(function: Callable[..., Tensor], *weights: Tensor) -> Linear:
    """``x -> function(x, *weights)``: one layer's weights bound into its matmul."""
    return lambda x: function(x, *weights)


def _linears(kind: str, shapes: list[tuple[int, int]], generator: torch.Generator) -> list[tuple[int, Linear]]:
    """One ``(K, apply)`` per weight of the given shapes."""
    out: list[tuple[int, Linear]] = []
    for n, k in shapes:
        weight = torch.randn(n, k, generator=generator) * 0.02
        if kind == "f32":
            out.append((k, _bind(F.linear, weight)))
        elif kind == "int8":
            q, s = reference.quantize_int8(weight)
            out.append((k, _bind(cpu.matmul_int8, q, s)))
        else:
            q, s, m = reference.quantize_int4(weight)
            out.append((k, _bind(cpu.matmul_int4, q, s, m)))
    return out


def _forward_time(linears: list[tuple[int, Linear]], m: int, repeats: int) -> float:
    inputs = {k: torch.randn(m, k) for k in {k for k, _ in linears}}
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up allocator and thread pool
        start = time.perf_counter()
        for k, apply in linears:
            apply(inputs[k])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _compare_isas(isas: list[str], batch_sizes: list[int], repeats: int) -> None:
    """Milliseconds per GGUF-mix forward for each variant in ``isas``, best of ``repeats`` rounds of turns."""
    generator = torch.Generator().manual_seed(0)
    gguf = _linears("int4", LAYER_SHAPES * LAYERS, generator) + _linears("int8", [LM_HEAD], generator)
    before = cpu.isa()
    print(f"threads={torch.get_num_threads()}  GGUF mix ms per forward, best of {repeats}")
    print(f"{'M':>4} " + " ".join(f"{isa:>14}" for isa in isas))
    try:
        for m in batch_sizes:
            best = dict.fromkeys(isas, float("inf"))
            for _ in range(repeats):
                for isa in isas:
                    cpu.set_isa(isa)
                    best[isa] = min(best[isa], _forward_time(gguf, m, 1))
            print(f"{m:>4} " + " ".join(f"{best[isa]:>14.2f}" for isa in isas))
    finally:
        cpu.set_isa(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128], help="batch sizes")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed forwards per cell; the best is shown")
    parser.add_argument("--isas", nargs="+", help="compare these kernel variants on the GGUF mix instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu.load()
    if args.isas:
        _compare_isas(args.isas, args.m, args.repeats)
        return

    generator = torch.Generator().manual_seed(0)
    layers = LAYER_SHAPES * LAYERS
    columns: dict[str, list[tuple[int, Linear]]] = {}
    for kind in ("f32", "int8", "int4"):
        columns[kind] = _linears(kind, layers + [LM_HEAD], generator)
    columns["gguf"] = columns["int4"][:-1] + columns["int8"][-1:]

    weights = {"f32": 4.0, "int8": 34 / 32, "int4": 20 / 32}  # bytes per weight, float16 scales and mins included
    params = sum(n * k for n, k in layers + [LM_HEAD])
    print(
        f"threads={args.threads}  params={params / 1e6:.1f}M  weight MB: "
        + "  ".join(f"{kind}={params * per / 1e6:.0f}" for kind, per in weights.items())
    )
    print(f"{'M':>4} " + " ".join(f"{name + ' ms':>10}" for name in columns) + "   int8 x  int4 x")
    for m in args.m:
        # Large batches take long per forward and vary little; fewer repeats keep the whole run short.
        repeats = max(2, args.repeats // max(1, m // 16))
        times = {name: _forward_time(linears, m, repeats) for name, linears in columns.items()}
        print(
            f"{m:>4} "
            + " ".join(f"{t:>10.2f}" for t in times.values())
            + f"   {times['f32'] / times['int8']:>6.2f}  {times['f32'] / times['int4']:>6.2f}"
        )


if __name__ == "__main__":
    main()
