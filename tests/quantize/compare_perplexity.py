"""Perplexity of Hugging Face model directories through transformers, on ``tokenmill eval perplexity``'s
bundled text and windows: the figure that compares ``tokenmill quantize`` with llm-compressor::

    python tests/quantize/compare_perplexity.py FLOAT_DIR TOKENMILL_DIR LLMCOMPRESSOR_DIR [--context-length 512]

Every directory is scored by the same code (transformers decompresses compressed-tensors checkpoints),
so the difference between two of them is the quantization alone.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def perplexity(model_dir: Path, text: str, context_length: int, stride: int) -> tuple[float, int]:
    import torch
    from tokenmill_plugins.commands.eval.perplexity import perplexity_windows
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    quantized = (model_dir / "config.json").read_text().count("compressed-tensors") > 0
    kwargs = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    token_ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    total, count = 0.0, 0
    for window in perplexity_windows(len(token_ids), context_length, stride):
        ids = torch.tensor([token_ids[window.begin : window.end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)  # [len, vocab]
        for target in range(window.first_scored, window.end):
            total += float(logprobs[target - window.begin - 1, token_ids[target]])
            count += 1
    return math.exp(-total / count), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--text", type=Path)
    args = parser.parse_args()
    from tokenmill_plugins.commands.eval.perplexity import default_text

    text = args.text.read_text() if args.text else default_text()
    results = {}
    for model_dir in args.models:
        results[model_dir] = perplexity(model_dir, text, args.context_length, args.context_length // 2)
        print(f"{model_dir}: perplexity {results[model_dir][0]:.4f} over {results[model_dir][1]} tokens", flush=True)
    if len(args.models) == 3:
        float_ppl, ours, theirs = (results[m][0] for m in args.models)
        print(f"{args.models[1].name} vs {args.models[2].name}: {100 * (ours / theirs - 1):+.2f}% "
              f"(float {float_ppl:.4f})")  # fmt: skip


if __name__ == "__main__":
    main()
