#!/usr/bin/env bash
# The GPU checks of issue 19 on a lent GPU machine, from the repository root: scripts/gpu/run.sh STAGE...
#   info     the GPU, the versions of torch, Triton, transformers and CuPy, and the GPU's measured ceilings
#   tests    the kernel, CUDA-graph, backend and engine tests on the GPU (pytest -n 8; log in $OUT)
#   llama8b  the Llama-3-8B-shaped random bf16 model (scripts/gpu/make_llama3_8b.py) in $LLAMA8B
#   bench    bench sweep at c=1 and 64 against transformers, and again with the torch layer kernels, the roofline
#            against the measured copy bandwidth, and a profile of decode steps (scripts/gpu/profile_decode.py)
#   eager    bench sweep at c=1 and 64 without CUDA graphs
#   async    async scheduling: its tests on the GPU, then bench sweep at c=1 and 64 without and with
#            --async-scheduling, twice, alternating (a first run can pay one-off costs such as Triton compiles),
#            when a first token leaves the engine in each mode (scripts/gpu/first_token.py), and the profile
#   step     bench step on the 8B model at batch 1 and 64
#   checks   info, tests (in the background) with llama8b and greedy on it
#   all      checks, then bench
#   greedy   greedy output against transformers on $TOKENMILL_GPU_MODELS (tests/gpu)
#   default  the default model's GGUF, joined from two halves carried by two calls (.gguf1/part1, kept in
#            /tmp/keep, then .gguf2/part2): greedy and bench decode against transformers, bench speculative (ngram),
#            bench kv-tiers (multi-turn, cpu tier)
# The machine has torch, triton, cupy and transformers but none of tokenmill's pure-Python dependencies: they
# travel as wheels in .whl/ (with the tokenmill wheels, for their entry points) and are installed first. The
# tree itself is imported from core/, plugins/ and kernels/. Logs and JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-out}
LLAMA8B=${LLAMA8B:-/tmp/llama3-8b}
export OUT LLAMA8B
mkdir -p "$OUT"
python3 -c "import msgspec, tokenmill" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 1
[ -f .gguf1/part1 ] && mkdir -p /tmp/keep && cp .gguf1/part1 /tmp/keep/  # the default model's first half
export PYTHONPATH=$PWD/core:$PWD/plugins:$PWD/kernels:$PWD
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TM="python3 -m tokenmill.cli"
for stage in "$@"; do
    echo "=== $stage $(date -u +%T)"
    case $stage in
    info)
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c "import torch, triton, transformers, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cupy', cupy.__version__)"
        timeout 120 python3 scripts/gpu/ceilings.py | tee "$OUT/ceilings.json"
        ;;
    tests)
        timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -p no:cacheprovider -q -n 8 --timeout 300 -rfEs \
            ${TESTS:-tests/kernels/test_paged_attention.py tests/kernels/test_quant_matmul_triton.py tests/kernels/test_layer_kernels_triton.py tests/plugins/test_layer_kernels_plugin.py tests/core/test_cuda_graphs.py tests/plugins/test_attention_plugins.py tests/plugins/test_auto_selection.py tests/testing/test_conformance.py tests/gpu} \
            >"$OUT/pytest-gpu.log" 2>&1
        echo "pytest exit $?"; tail -40 "$OUT/pytest-gpu.log"
        ;;
    llama8b)
        [ -f "$LLAMA8B/config.json" ] || timeout 300 python3 scripts/gpu/make_llama3_8b.py "$LLAMA8B"
        ;;
    bench)
        # Defaults (CUDA graphs, the triton layer kernels) against transformers, then the torch layer kernels.
        [ -f "$OUT/ceilings.json" ] || timeout 120 python3 scripts/gpu/ceilings.py | tee "$OUT/ceilings.json"
        copy=$(python3 -c "import json; print(round(json.load(open('$OUT/ceilings.json'))['copy_gbs']))")
        common="--model $LLAMA8B --concurrency 1,64 --input-len 128 --output-len 128 --peak-bandwidth-gbs $copy --no-progress"
        timeout 300 $TM bench sweep $common --output-json "$OUT/sweep-graphs.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -22
        timeout 150 $TM bench sweep $common --layer-kernels torch --no-hf-baseline --output-json "$OUT/sweep-torch-kernels.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -12
        timeout 150 python3 scripts/gpu/profile_decode.py "$LLAMA8B" >"$OUT/profile.txt" 2>&1
        grep -A16 "^=== batch" "$OUT/profile.txt" | cut -c1-150
        grep -A20 "^--- host" "$OUT/profile.txt"
        ;;
    eager)
        # The defaults without CUDA graphs (graphs on: the bench stage).
        copy=$(python3 -c "import json; print(round(json.load(open('$OUT/ceilings.json'))['copy_gbs']))")
        timeout 150 $TM bench sweep --model "$LLAMA8B" --concurrency 1,64 --input-len 128 --output-len 128 \
            --peak-bandwidth-gbs "$copy" --no-progress --no-cuda-graphs --no-hf-baseline \
            --output-json "$OUT/sweep-eager.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -12
        ;;
    async)
        timeout 200 python3 -m pytest -p no:cacheprovider -q --timeout 180 -rfEs tests/core/test_async_scheduling.py \
            tests/gpu/test_features_on_gpu.py -k "async" >"$OUT/pytest-async.log" 2>&1 &
        tests=$!
        "$0" llama8b
        wait $tests; echo "pytest exit $?"; tail -5 "$OUT/pytest-async.log"
        [ -f "$OUT/ceilings.json" ] || timeout 120 python3 scripts/gpu/ceilings.py | tee "$OUT/ceilings.json"
        copy=$(python3 -c "import json; print(round(json.load(open('$OUT/ceilings.json'))['copy_gbs']))")
        common="--model $LLAMA8B --concurrency 1,64 --input-len 128 --output-len 128 --peak-bandwidth-gbs $copy --no-progress --no-hf-baseline"
        for run in 1 2; do
            for mode in no-async-scheduling async-scheduling; do
                echo "--- $mode, run $run"
                timeout 120 $TM bench sweep $common --$mode --output-json "$OUT/sweep-$mode-$run.json" 2>&1 |
                    grep -v "^INFO\|it/s\]" | grep "^ *[0-9]"
            done
        done
        timeout 60 python3 scripts/gpu/first_token.py "$LLAMA8B" 2>&1 | grep "^async_scheduling"
        timeout 100 python3 scripts/gpu/profile_decode.py "$LLAMA8B" --async-scheduling >"$OUT/profile.txt" 2>&1
        grep -A12 "^=== batch" "$OUT/profile.txt" | cut -c1-150
        grep -A12 "^--- host" "$OUT/profile.txt"
        ;;
    step)
        timeout 150 $TM bench step --model "$LLAMA8B" --batch-size 1,64 --context-len 256 --kv-cache-memory 16GiB \
            --output-json "$OUT/step.json" 2>&1 | grep -v "^INFO" | tail -14
        ;;
    checks)
        # info, then the tests in the background while the 8B model is written and checked against transformers.
        "$0" info
        "$0" tests >/tmp/tests.out 2>&1 &
        tests=$!
        "$0" llama8b && TOKENMILL_GPU_MODELS=$LLAMA8B GREEDY_TIMEOUT=300 "$0" greedy
        wait $tests
        cat /tmp/tests.out
        ;;
    all)
        # What one call fits (about 9 minutes): checks, then the benchmarks on a quiet GPU.
        "$0" checks bench
        ;;
    greedy)
        timeout "${GREEDY_TIMEOUT:-400}" python3 -m pytest -p no:cacheprovider -q -s --timeout 380 tests/gpu 2>&1 | tee "$OUT/greedy.log" | grep -v "it/s\]" | tail -15
        ;;
    default)
        gguf=${DEFAULT_GGUF:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}
        [ -f "$gguf" ] || cat /tmp/keep/part1 .gguf2/part2 >"$gguf" || exit 1
        TOKENMILL_GPU_MODELS=$gguf timeout 150 python3 -m pytest -p no:cacheprovider -q -s --timeout 140 \
            tests/gpu -k "greedy and gguf" 2>&1 | grep -v "it/s\]" | tail -6
        timeout 180 $TM bench decode --model "$gguf" --num-requests 3 --no-progress \
            --output-json "$OUT/decode-default.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -22
        timeout 180 $TM bench speculative --model "$gguf" --speculative-config '{"method": "ngram"}' --workload copy \
            --concurrency 1,32 --num-prompts 8 --rounds 2 --output-json "$OUT/speculative-default.json" 2>&1 |
            grep -v "^INFO\|it/s\]" | tail -16
        timeout 180 $TM bench kv-tiers --model "$gguf" --workload multi-turn --output-json "$OUT/kv-tiers-default.json" \
            2>&1 | grep -v "^INFO\|it/s\]" | tail -12
        ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
echo "=== done $(date -u +%T)"
