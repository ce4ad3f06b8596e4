"""Where a decode step's GPU time goes: torch.profiler over decode steps of a batch, with the engine's defaults.

    python3 scripts/gpu/profile_decode.py MODEL [--batch-sizes 1,64] [--context 256]

For each batch size: requests of ``--context`` random prompt tokens are prefilled, then 20 decode steps are timed
(wall clock, synchronized) and 10 more run under the profiler. Prints the step time and the kernels by total GPU
time (the CUDA graph's kernels included), and the share of the step the GPU was busy. Then 20 steps under
cProfile: where the host's time goes, the wait for the GPU included (in ``tolist``, which synchronizes).
"""

import argparse
import cProfile
import io
import pstats
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill.engine import now
from tokenmill.llm import LLM
from tokenmill.messages import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory="16GiB", async_scheduling=args.async_scheduling)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
        for request_id in ids:
            prompt = [rng.randrange(100, 30000) for _ in range(args.context)]
            engine.add_request(EngineCoreRequest(request_id, prompt, params, [], now()))
        waiting = set(ids)
        while waiting:  # prefill (with async scheduling a step's tokens come one call later)
            waiting -= {output.request_id for output in engine.step() if output.new_token_ids}
        for _ in range(3):  # the first decode steps
            engine.step()
        sync()
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        sync()
        step_ms = (time.perf_counter() - start) / 20 * 1000
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                engine.step()
            sync()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_ms = sum(e.self_device_time_total for e in events) / 1000 / 10
        print(
            f"\n=== batch {batch_size}, context ~{args.context}: step {step_ms:.2f} ms wall, "
            f"{gpu_ms:.2f} ms of GPU kernels per step ({gpu_ms / step_ms:.0%} busy)"
        )
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
        host = cProfile.Profile()
        host.enable()
        for _ in range(20):
            engine.step()
        sync()
        host.disable()
        report = io.StringIO()
        pstats.Stats(host, stream=report).sort_stats("tottime").print_stats(18)
        print(f"--- host, 20 steps, by own time (batch {batch_size})")
        print("\n".join(line[:150] for line in report.getvalue().splitlines() if line.strip()))
        engine.abort_requests(ids)
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
