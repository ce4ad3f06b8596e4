"""Write a Llama-3-8B-shaped model with random bf16 weights, as a Hugging Face directory, for the GPU benchmarks.

    python3 scripts/gpu/make_llama3_8b.py DIRECTORY [--num-layers N]

The shapes are Llama-3-8B's (hidden 4096, 32 layers, 32 heads of 128, 8 KV heads, MLP 14336, vocabulary 128256,
untied output projection, rope theta 500000). Weights are drawn on the GPU (normal, std 0.02, transformers' own
initialisation; norms 1) and saved as safetensors. The tokenizer is a placeholder with one word per id
("t0" ... "t128255"): the benchmarks send token ids, and nothing reads the text.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--num-layers", type=int, default=32)
    args = parser.parse_args()
    start = time.perf_counter()
    config = transformers.LlamaConfig(
        **{**LLAMA3_8B, "num_hidden_layers": args.num_layers}, architectures=["LlamaForCausalLM"]
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(args.directory, max_shard_size="4GB")
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(args.directory / "tokenizer.json"))
    special = {"bos_token": f"t{config.bos_token_id}", "eos_token": f"t{config.eos_token_id}"}
    (args.directory / "tokenizer_config.json").write_text(json.dumps(special))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.directory}: {parameters / 1e9:.2f}B parameters in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
