"""Small GGUF files with tokenizer metadata, written with gguf.GGUFWriter.

Each has a one-tensor "model" so that transformers accepts it as a reference:
``AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# SentencePiece BPE pieces in merge order (best first). Each is two earlier pieces or chars joined.
SPM_MERGED = [
    "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁s", "ll", "▁w", "or", "ld", "▁wor", "▁world",
    "▁h", "▁he", "▁hell", "▁hello", "is", "▁is", "ing", "▁in", "▁▁", "▁▁▁▁", "de", "▁de", "▁def",
    "▁(", "):", "▁=", "▁==", "re", "▁re", "▁ret", "ur", "urn", "▁return", "▁f", "oo", "▁foo", "▁1",
    "12", "▁中", "é", "▁é", "▁c", "af", "▁caf", "▁café",
]  # fmt: skip
SPM_CHARS = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()[]{}<>=_/\"#+*中")
SPM_SPECIAL = [
    ("<unk>", UNKNOWN),
    ("<s>", CONTROL),
    ("</s>", CONTROL),
    ("<|im_start|>", CONTROL),
    ("<|im_end|>", CONTROL),
]
SPM_USER_DEFINED = ["<tool>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _start(path: Path) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


def _finish(writer: gguf.GGUFWriter, num_tokens: int) -> None:
    writer.add_tensor("token_embd.weight", np.zeros((num_tokens, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """Tokens, token types and scores of a SentencePiece-style BPE vocabulary with byte fallback."""
    tokens = [token for token, _ in SPM_SPECIAL]
    types = [kind for _, kind in SPM_SPECIAL]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [BYTE] * 256
    merged = [piece for piece in dict.fromkeys(SPM_MERGED) if piece not in SPM_CHARS]
    tokens += merged + SPM_CHARS + SPM_USER_DEFINED
    types += [NORMAL] * (len(merged) + len(SPM_CHARS)) + [USER_DEFINED] * len(SPM_USER_DEFINED)
    scores = [0.0] * (len(SPM_SPECIAL) + 256)
    scores += [-float(i) for i in range(len(merged))]
    scores += [-1000.0 - i for i in range(len(SPM_CHARS))] + [0.0] * len(SPM_USER_DEFINED)
    return tokens, types, scores


def write_llama_gguf(path: Path, *, add_space_prefix: bool = True, add_bos_token: bool = True) -> Path:
    """A ``tokenizer.ggml.model = llama`` file: scores, no merges, byte-fallback tokens."""
    tokens, types, scores = spm_vocab()
    writer = _start(path)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_eot_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(add_bos_token)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(CHAT_TEMPLATE)
    _finish(writer, len(tokens))
    return path


def byte_alphabet() -> list[str]:
    """GPT-2's spelling of bytes 0..255, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[byte] for byte in range(256)]


# "Ġ 1" ranks before "1 2", so how digits are split off decides the tokens of " 12345".
BPE_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ 1", "Ġ1 2", "1 2", "12 3", "4 5"]


def write_gpt2_gguf(path: Path, pre: str) -> Path:
    """A small byte-level BPE file (``tokenizer.ggml.model = gpt2``) with digit merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_alphabet()]
    tokens += [merge.replace(" ", "") for merge in BPE_MERGES] + ["<think>"]
    types = [CONTROL] * 3 + [NORMAL] * (len(tokens) - 4) + [USER_DEFINED]
    writer = _start(path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(BPE_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    _finish(writer, len(tokens))
    return path


def write_gguf_with_model(path: Path, model: str) -> Path:
    """A file naming tokenizer model ``model`` with a trivial vocabulary (for error paths)."""
    writer = _start(path)
    writer.add_tokenizer_model(model)
    writer.add_token_list(["[UNK]", "a", "b"])
    writer.add_token_types([UNKNOWN, NORMAL, NORMAL])
    _finish(writer, 3)
    return path


def write_gguf_without_tokenizer(path: Path) -> Path:
    writer = _start(path)
    _finish(writer, 3)
    return path
