"""Streaming detokenization must add up to a one-shot decode, without partial characters."""

from __future__ import annotations

import random

import pytest

from tests.tokenizer.conftest import CORPUS
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer

REPLACEMENT = "\ufffd"
STREAM_TEXTS = [
    *CORPUS,
    "中文测试：流式输出不能出现乱码。",
    "👩‍👩‍👧‍👦👨🏽‍💻🏳️‍🌈 family, coder, flag",
    "mixed 中 and é and 🙂 then hello world",
    "文文文 字 🙂🙂",
    " hello  world\n\tdef foo():\n\t\treturn 12",
    "Ωμέγα Привет שלום नमस्ते",
]


def _random_texts(count: int, seed: int) -> list[str]:
    pools = ["hello", " world", " ", "\n", "\t", "中", "文", "é", "🙂", "👩‍👩‍👧", "12", "def", "<|im_end|>", "ü", "ß"]
    rng = random.Random(seed)
    return ["".join(rng.choice(pools) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def _stream(tok: Tokenizer, ids: list[int], chunk_sizes: list[int] | None = None, **kwargs: object) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)  # type: ignore[arg-type]
    deltas, start = [], 0
    sizes = iter(chunk_sizes or [])
    while start < len(ids):
        size = next(sizes, 1)
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.fixture(params=["smollm2", "tiny_llama"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


def test_one_token_at_a_time_adds_up_to_decode(tokenizer: Tokenizer) -> None:
    for text in STREAM_TEXTS + _random_texts(60, seed=1):
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        deltas = _stream(tokenizer, ids)
        assert "".join(deltas) == full, text
        assert deltas[-1] == ""  # valid text leaves nothing for finish()
        if REPLACEMENT not in full:
            assert not any(REPLACEMENT in delta for delta in deltas), (text, deltas)


def test_streaming_keeps_special_tokens_when_asked(tokenizer: Tokenizer) -> None:
    for text in ["<|im_start|>user\nhi 中<|im_end|>", "a<|im_end|>b <|im_start|> c"]:
        ids = tokenizer.encode(text)
        deltas = _stream(tokenizer, ids, skip_special_tokens=False)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=False)
        assert "<|im_end|>" in "".join(deltas)


def test_chunked_pushes_give_the_same_text(tokenizer: Tokenizer) -> None:
    rng = random.Random(2)
    for text in STREAM_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        sizes = [rng.randint(1, 4) for _ in ids]
        assert "".join(_stream(tokenizer, ids, sizes)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_character_is_held_back_until_complete(tiny_llama_tokenizer: Tokenizer) -> None:
    tok = tiny_llama_tokenizer
    ids = tok.encode("a文", add_special_tokens=False)  # "文" is three byte-fallback tokens
    assert tok.convert_ids_to_tokens(ids[-3:]) == ["<0xE6>", "<0x96>", "<0x87>"]
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([token_id]) for token_id in ids] == ["a", "", "", "文"]
    assert detok.text == "a文"


def test_byte_level_split_character_is_held_back(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    # Find a character that byte-level BPE spells with more than one token.
    char = next(c for c in "𝔘𝔫𝔦𝔠𝔬𝔡𝔢🦀🫠" if len(tok.encode(c, add_special_tokens=False)) > 1)
    ids = tok.encode(char, add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == char


def test_finish_flushes_an_incomplete_character(tiny_llama_tokenizer: Tokenizer) -> None:
    tok = tiny_llama_tokenizer
    ids = tok.encode("hi文", add_special_tokens=False)[:-1]  # cut the last byte of "文"
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([token_id]) for token_id in ids) == "hi"
    tail = detok.finish()
    assert tail and set(tail) == {REPLACEMENT}
    assert detok.text == tok.decode(ids)
    assert detok.finish() == ""


def test_prompt_context_keeps_leading_space(tiny_llama_tokenizer: Tokenizer) -> None:
    tok = tiny_llama_tokenizer
    prompt = tok.encode("hello")
    generated = tok.encode(" world 中 hello", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(generated[:1]) == ["▁world"]
    # Alone, SentencePiece decoding drops the first token's space; after a prompt it must stay.
    assert tok.decode(generated).startswith("world")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas = [detok.push([token_id]) for token_id in generated]
    full = tok.decode(prompt + generated, skip_special_tokens=True)
    prompt_text = tok.decode(prompt, skip_special_tokens=True)
    assert "".join(deltas) == full[len(prompt_text) :] == " world 中 hello"
    assert deltas[0] == " world"
    assert detok.num_generated_tokens == len(generated)


def test_prompt_ending_in_special_tokens(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert isinstance(prompt, list)
    generated = tok.encode("Hello! 你好 🙂<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    text = "".join(detok.push([token_id]) for token_id in generated) + detok.finish()
    assert text == "Hello! 你好 🙂"
    assert detok.push([]) == ""
