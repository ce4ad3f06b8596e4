"""Micro-benchmark: one layer's CPU paged attention, per kernel variant, for decode and verification shapes.

``python -m tokenmill_kernels.paged_attention.bench [--context 300] [--heads 9 3 64] [--cache-dtype float16]``

Times ``cpu.paged_attention`` alone (the cache already written) for one request decoding one token, one request
verifying 8 tokens at once (a speculative step) and 32 requests decoding one token each, every request with
``--context`` tokens cached in its own blocks. Prints microseconds per call, best of ``--rounds`` rounds in
which the variants (``--isas``, default every one the CPU supports) take turns. SmolLM2-135M's layers are
the default shape: 9 query heads over 3 kv heads of 64.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill_kernels.paged_attention import cpu

BLOCK_SIZE = 16
SHAPES = {"1 request x 1 token": (1, 1), "1 request x 8 tokens": (1, 8), "32 requests x 1 token": (32, 1)}


def _inputs(num_reqs: int, num_new: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype) -> tuple:
    """The kernel's arguments for ``num_reqs`` requests of ``context`` cached tokens plus ``num_new`` new ones."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_req = -(-(context + num_new) // BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_reqs * blocks_per_req, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    cache = cache.to(dtype)
    tables = torch.arange(num_reqs * blocks_per_req, dtype=torch.int32).reshape(num_reqs, blocks_per_req)
    token_req = torch.arange(num_reqs, dtype=torch.int32).repeat_interleave(num_new)
    positions = (context + torch.arange(num_new, dtype=torch.int64)).repeat(num_reqs)
    query = torch.randn(num_reqs * num_new, num_heads, head_dim, generator=generator)
    return query, cache[0], cache[1], tables, token_req, positions, head_dim**-0.5, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=300, help="tokens cached per request")
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    parser.add_argument("--cache-dtype", choices=["float32", "float16"], default="float16")
    parser.add_argument("--isas", nargs="+", help="variants to compare (default: every supported one)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of turns; the best is shown")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per variant per round")
    args = parser.parse_args()
    isas = args.isas or cpu.supported_isas()
    before = cpu.isa()
    print(f"threads={torch.get_num_threads()}  context={args.context}  heads={args.heads}  cache={args.cache_dtype}")
    print(f"{'shape':>24} " + " ".join(f"{isa + ' us':>12}" for isa in isas))
    try:
        for name, (num_reqs, num_new) in SHAPES.items():
            inputs = _inputs(num_reqs, num_new, args.context, tuple(args.heads), getattr(torch, args.cache_dtype))
            best = dict.fromkeys(isas, float("inf"))
            for _ in range(args.rounds):
                for isa in isas:
                    cpu.set_isa(isa)
                    cpu.paged_attention(*inputs)  # warm up
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        cpu.paged_attention(*inputs)
                    best[isa] = min(best[isa], (time.perf_counter() - started) / args.calls * 1e6)
            print(f"{name:>24} " + " ".join(f"{best[isa]:>12.1f}" for isa in isas))
    finally:
        cpu.set_isa(before)


if __name__ == "__main__":
    main()
