"""Quantize a Hugging Face model with llm-compressor, for comparison with ``tokenmill quantize``.

Run it with a Python that has llm-compressor (it cannot share tokenmill's environment: it pins an
older transformers)::

    /tmp/lcvenv/bin/python tests/quantize/make_reference_checkpoints.py MODEL_DIR OUT_DIR \
        --scheme W4A16 [--group-size 128] [--calibration FILE] [--num-samples 64] [--seq-len 512]

The calibration samples are built exactly as ``tokenmill quantize`` builds them (the text tokenized once,
cut into consecutive windows of ``--seq-len`` tokens; ``tokenmill_plugins.commands.quantize.calibration``, read
from this checkout without importing tokenmill), so both tools see the same tokens. ``--scheme`` is a
compressed-tensors preset (W4A16, W4A16_ASYM, FP8_DYNAMIC, W8A8); W4A16 and W8A8 run GPTQModifier, the
others QuantizationModifier (round to nearest), and ``--awq`` runs AWQModifier before W4A16_ASYM.
"""

from __future__ import annotations

import argparse
from pathlib import Path

_DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "plugins/tokenmill_plugins/commands/quantize/data/calibration.txt"


def calibration_windows(tokenizer_dir: Path, text_file: Path, num_samples: int, seq_len: int) -> list[list[int]]:
    """Mirror of ``tokenmill_plugins.commands.quantize.calibration.calibration_samples``: consecutive windows of the
    tokenized text (no special tokens), at most ``num_samples`` of them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    token_ids = tokenizer.encode(text_file.read_text(encoding="utf-8"), add_special_tokens=False).ids
    windows = [token_ids[i : i + seq_len] for i in range(0, len(token_ids) - seq_len + 1, seq_len)]
    return windows[:num_samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--scheme", default="W4A16")
    parser.add_argument("--awq", action="store_true")
    parser.add_argument("--calibration", type=Path, default=_DEFAULT_TEXT)
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=128, help="W4A16 / W4A16_ASYM only")
    args = parser.parse_args()

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = calibration_windows(args.model, args.calibration, args.num_samples, args.seq_len)
    dataset = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    scheme: dict[str, object] = {"scheme": args.scheme}
    if args.scheme in ("W4A16", "W4A16_ASYM"):  # the preset with another group size
        weights = dict(num_bits=4, type="int", symmetric=args.scheme == "W4A16", strategy="group")
        scheme = {
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**weights, "group_size": args.group_size}}}
        }
    if args.awq:
        recipe = [AWQModifier(ignore=["lm_head"], **scheme)]
    elif args.scheme in ("W4A16", "W8A8"):
        recipe = [GPTQModifier(ignore=["lm_head"], **scheme)]
    else:
        recipe = [QuantizationModifier(ignore=["lm_head"], **scheme)]
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(windows),
        max_seq_length=args.seq_len,
        shuffle_calibration_samples=False,
        output_dir=str(args.output),
    )
    print(f"{len(windows)} samples of {args.seq_len} tokens -> {args.output}")


if __name__ == "__main__":
    main()
