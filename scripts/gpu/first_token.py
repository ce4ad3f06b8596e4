"""When a request's first token comes out of the engine, with and without async scheduling, in process.

For each mode, 10 requests of ``--prompt-len`` random tokens run one after another; for each, the time from
``add_request`` to the ``step`` call that returns its first token, and how long each of those ``step`` calls
took. Run on a GPU (``scripts/gpu/run.sh async``): over HTTP the first token came 5.6 ms later with async
scheduling at c=1 on an H100, about one decode step, which the host-side order alone does not explain.

    python3 scripts/gpu/first_token.py MODEL [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.step_loop import SyncLoop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(args.model, kv_cache_memory="4GiB", async_scheduling=True)
    engine = llm.engine
    loops = {True: engine.loop, False: SyncLoop(engine.scheduler, engine.executor)}
    for mode in (False, True, False, True):  # alternating, one engine: switched between requests, with none running
        engine.loop = loops[mode]
        first_ms: list[float] = []
        calls: list[list[float]] = []
        for index in range(args.requests + 1):  # the first one warms up
            prompt = [rng.randrange(100, 30000) for _ in range(args.prompt_len)]
            request_id = f"r{index}"
            started = time.perf_counter()
            engine.add_request(EngineCoreRequest(request_id, prompt, params, [], now()))
            durations = []
            while True:
                call_started = time.perf_counter()
                outputs = engine.step()
                durations.append((time.perf_counter() - call_started) * 1000)
                if any(o.request_id == request_id and o.new_token_ids for o in outputs):
                    break
            if index:
                first_ms.append((time.perf_counter() - started) * 1000)
                calls.append(durations)
            while engine.has_unfinished_requests():
                engine.step()
        print(
            f"async_scheduling={mode}: first token p50 {statistics.median(first_ms):.2f} ms "
            f"(min {min(first_ms):.2f}); step calls until it, ms: {[round(d, 2) for d in calls[len(calls) // 2]]}"
        )


if __name__ == "__main__":
    main()
