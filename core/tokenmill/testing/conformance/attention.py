"""``check_attention_backend``: a backend against the torch reference on random paged steps."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec
from tokenmill.attention.kv_quant import is_quantized_kv, quantize_kv
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.step_batch import SequenceChunk, build_batch
from tokenmill.testing.conformance._util import conformance_check, fail, instantiate

#: Absolute and relative tolerance per compute dtype, for outputs of the same math in another order.
ATTENTION_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (5e-5, 5e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class _PlannedRequest:
    chunks: tuple[int, ...]  # tokens computed per step: prompt chunks, then 1 per decode step


def _plan(block_size: int) -> list[_PlannedRequest]:
    """Requests that, over four steps, mix a prompt read in one go, chunked prefill, decode, a prompt
    longer than 64 tokens (where kernels often switch paths) and block boundaries crossed mid-step."""
    return [
        _PlannedRequest((2 * block_size + 3, 1, 1, 1)),  # a prompt, then decode across a block boundary
        _PlannedRequest((3, 1, 1, 1)),  # shorter than one block
        _PlannedRequest((block_size - 1, 3, 1, 1)),  # chunked prefill, the second chunk crosses a block
        _PlannedRequest((70, 1, 1)),  # long prompt, finishes a step early
        _PlannedRequest((0, 0, 5, 1)),  # arrives in step 3
    ]


@conformance_check
def check_attention_backend(
    backend: type[AttentionBackend] | AttentionBackend,
    *,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    head_dims: tuple[int, ...] = (32, 64),
    block_sizes: tuple[int, ...] = (4, 16),
    tolerances: tuple[float, float] | None = None,
    seed: int = 0,
) -> None:
    """Check an attention backend against ``TorchAttentionBackend`` on random paged inputs.

    Both run the same four steps (prompts read whole and in chunks, decode, a 70-token prompt, a
    request arriving late, block tables out of order, sliding windows, grouped and multi-query heads),
    each on its own cache: unused blocks start as random garbage, so a backend that reads past a
    request's tokens differs. For the model's dtype and every cache dtype in ``kv_cache_dtypes`` that
    the reference stores too, outputs must agree within ``tolerances`` (default per dtype,
    ``ATTENTION_TOLERANCES``), have the query's shape and dtype, leave the inputs unchanged and, when the
    backend keeps the default cache layout, write the same keys and values (for a quantized cache, ``fp8``
    or ``int8``, the same bytes: codes and scales as ``tokenmill.attention.kv_quant`` defines them).

    :param backend: the class (built with no arguments, as the engine builds it) or an instance.
    :param device: where to run; default ``cuda`` when the backend supports it and a GPU is visible, else ``cpu``
        when it supports that, else ``cuda``.
    :raises AssertionError: naming the case and what differs.
    """
    candidate = instantiate(backend)
    if device is None:
        on_gpu = "cuda" in candidate.supported_devices and torch.cuda.is_available()
        device = "cuda" if on_gpu or "cpu" not in candidate.supported_devices else "cpu"
    reference = TorchAttentionBackend()
    cache_dtypes = [dtype] + [d for d in candidate.kv_cache_dtypes if d != dtype and d in reference.kv_cache_dtypes]
    atol, rtol = tolerances or ATTENTION_TOLERANCES[dtype]
    case = 0
    for block_size in block_sizes:
        for head_dim in head_dims:
            for num_heads, num_kv_heads in ((4, 2), (4, 4), (8, 1)):
                # Other cache dtypes change how K/V are stored, not the head layout: one layout covers them.
                for cache_dtype in cache_dtypes if (num_heads, num_kv_heads) == (4, 2) else cache_dtypes[:1]:
                    specs = [
                        AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5),
                        AttentionLayerSpec(num_heads, num_kv_heads, head_dim, 0.7 * head_dim**-0.5, sliding_window=6),
                    ]
                    where = (
                        f"{type(candidate).__name__}: block_size={block_size} head_dim={head_dim} "
                        f"heads={num_heads}/{num_kv_heads} dtype={dtype} kv_cache_dtype={cache_dtype}"
                    )
                    _compare(candidate, reference, specs, block_size, dtype, cache_dtype, device,
                             seed + case, (atol, rtol), where)  # fmt: skip
                    case += 1


def _compare(
    candidate: AttentionBackend,
    reference: AttentionBackend,
    specs: list[AttentionLayerSpec],
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: str,
    seed: int,
    tolerances: tuple[float, float],
    where: str,
) -> None:
    plan = _plan(block_size)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    final_lens = [sum(request.chunks) for request in plan]
    num_blocks = sum(-(-length // block_size) for length in final_lens) + 3  # 3 never used: garbage only
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-length // block_size))] for length in final_lens]
    spec = specs[0]

    def new_caches(backend: AttentionBackend) -> list[torch.Tensor]:
        # The same garbage for both when the layouts agree, so their caches can be compared exactly.
        garbage = torch.Generator().manual_seed(seed + 1)
        shape = backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, cache_dtype)
        if is_quantized_kv(cache_dtype):  # garbage rows with finite scales: random bytes could read as NaN
            rows = torch.randn(*shape[:-1], spec.head_dim, generator=garbage)
            return [quantize_kv(rows, cache_dtype).to(device) for _ in specs]
        return [torch.randn(shape, generator=garbage).to(device, cache_dtype) for _ in specs]

    backends = {"reference": reference, "candidate": candidate}
    caches = {role: new_caches(backend) for role, backend in backends.items()}
    same_layout = tuple(caches["candidate"][0].shape) == tuple(caches["reference"][0].shape)
    num_steps = max(len(request.chunks) for request in plan)
    computed = [0] * len(plan)
    for step in range(num_steps):
        chunks, rows = [], []
        for i, request in enumerate(plan):
            num_new = request.chunks[step] if step < len(request.chunks) else 0
            if num_new:
                chunks.append(SequenceChunk([1] * num_new, computed[i], tables[i]))
                rows.append(i)
                computed[i] += num_new
        metadata = {}
        for role, backend in backends.items():
            # Each backend prepares its own copy, once per step: prepare keeps its state in the metadata.
            _, metadata[role] = build_batch(chunks, block_size, device)
            backend.prepare(metadata[role], block_size)
        num_tokens = metadata["reference"].num_tokens
        starts = metadata["reference"].query_start_loc.tolist()
        for layer, layer_spec in enumerate(specs):
            query = torch.randn(num_tokens, layer_spec.num_heads, layer_spec.head_dim, generator=generator)
            key = torch.randn(num_tokens, layer_spec.num_kv_heads, layer_spec.head_dim, generator=generator)
            value = torch.randn(num_tokens, layer_spec.num_kv_heads, layer_spec.head_dim, generator=generator)
            inputs = [t.to(device, dtype) for t in (query, key, value)]
            originals = [t.clone() for t in inputs]
            outputs = {
                role: backend.forward(layer_spec, inputs[0], inputs[1], inputs[2], caches[role][layer], metadata[role])
                for role, backend in backends.items()
            }
            here = f"{where}, step {step + 1}, layer {layer} (sliding_window={layer_spec.sliding_window})"
            got, expected = outputs["candidate"], outputs["reference"]
            if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
                fail(f"{here}: forward returned {tuple(got.shape)} {got.dtype}, "
                     f"expected {tuple(expected.shape)} {expected.dtype}")  # fmt: skip
            if any(not torch.equal(t, o) for t, o in zip(inputs, originals, strict=True)):
                fail(f"{here}: forward changed its query, key or value argument")
            _assert_close(got, expected, tolerances, f"{here}: output", rows, starts)
            if same_layout and is_quantized_kv(cache_dtype):
                written, expected_bytes = (caches[role][layer].view(torch.uint8) for role in ("candidate", "reference"))
                if not torch.equal(written, expected_bytes):
                    where_bytes = (written != expected_bytes).nonzero()[0].tolist()
                    fail(f"{here}: KV cache bytes differ from the reference's at {where_bytes} (codes and scales of "
                         "tokenmill.attention.kv_quant)")  # fmt: skip
            elif same_layout:
                _assert_close(caches["candidate"][layer], caches["reference"][layer], (0.0, 0.0),
                              f"{here}: KV cache contents", None, None)  # fmt: skip


def _assert_close(
    got: torch.Tensor,
    expected: torch.Tensor,
    tolerances: tuple[float, float],
    what: str,
    rows: list[int] | None,
    starts: list[int] | None,
) -> None:
    atol, rtol = tolerances
    got, expected = got.float().cpu(), expected.float().cpu()
    error = (got - expected).abs() - rtol * expected.abs()
    if bool(torch.isfinite(got).all()) and float(error.max()) <= atol:
        return
    worst = int(error.flatten().nan_to_num(float("inf")).argmax())
    token = worst // (got.numel() // got.shape[0])
    who = ""
    if rows is not None and starts is not None:
        request = next(i for i in range(len(rows)) if starts[i] <= token < starts[i + 1])
        who = f" (token {token}, planned request {rows[request]})"
    fail(
        f"{what} differs from the reference{who}: got {got.flatten()[worst].item():.6g}, "
        f"expected {expected.flatten()[worst].item():.6g} (atol={atol}, rtol={rtol})"
    )
