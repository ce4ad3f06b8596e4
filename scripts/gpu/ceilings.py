"""The GPU's two ceilings, measured: device-to-device copy bandwidth (bytes read + written) and a bf16 matmul.

Prints one JSON line; the copy bandwidth is the roofline's denominator in docs/benchmarks.md (GPU section).
"""

import json

import torch


def timed_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


src = torch.randn(1024**3, device="cuda", dtype=torch.float32)  # 4 GiB, far over the L2
dst = torch.empty_like(src)
copy_ms = timed_ms(lambda: dst.copy_(src))
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
mm_ms = timed_ms(lambda: a @ b)
print(
    json.dumps(
        {
            "device": torch.cuda.get_device_name(),
            "copy_gbs": 2 * src.numel() * 4 / copy_ms / 1e6,
            "bf16_matmul_tflops": 2 * 8192**3 / mm_ms / 1e9,
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        }
    )
)
