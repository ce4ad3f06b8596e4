"""Tokenizers rebuilt from GGUF metadata must behave like transformers' for the same file."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer.conftest import CORPUS
from tests.tokenizer.synthetic_gguf import (
    write_gguf_with_model,
    write_gguf_without_tokenizer,
    write_gpt2_gguf,
    write_llama_gguf,
)
from tokenmill.tokenizer import Tokenizer


def _assert_same_encoding(ours: Tokenizer, reference: Any, texts: list[str]) -> None:
    for text in texts:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens)
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == expected, (text, add_special_tokens)
            assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids), text
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), (
                    text,
                    skip,
                )


def _reference_special_ids(reference: Any) -> list[int]:
    """Ids transformers drops with skip_special_tokens (``all_special_ids`` lists only named ones)."""
    return sorted(token_id for token_id, token in reference.added_tokens_decoder.items() if token.special)


# -- the default model (gpt2 / byte-level BPE) -------------------------------------------------


def test_smollm2_encodes_and_decodes_corpus_like_transformers(smollm2_tokenizer: Tokenizer, hf_smollm2: Any) -> None:
    _assert_same_encoding(smollm2_tokenizer, hf_smollm2, CORPUS)


def test_smollm2_decodes_arbitrary_id_runs_like_transformers(smollm2_tokenizer: Tokenizer, hf_smollm2: Any) -> None:
    # Random ids split characters and mix in special tokens, which encoding real text never does.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), rng.randrange(17))  # 0..16 are control tokens
        for skip in (False, True):
            assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip) == hf_smollm2.decode(
                ids, skip_special_tokens=skip
            )


def test_smollm2_metadata(smollm2_tokenizer: Tokenizer, hf_smollm2: Any) -> None:
    tok = smollm2_tokenizer
    assert tok.vocab_size == len(hf_smollm2) == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.eos_token_ids == (2,)
    assert (tok.pad_token_id, tok.unk_token_id) == (2, 0)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert sorted(tok.special_token_ids) == _reference_special_ids(hf_smollm2) == list(range(17))
    assert tok.is_special(1) and not tok.is_special(17)
    # add_bos_token is False in the metadata: no BOS, even though bos_token exists.
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_smollm2_keeps_special_tokens_whole(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("a<|im_start|>b<repo_name>c")
    assert 1 in ids and 3 in ids
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == "abc"


def test_smollm2_splits_every_number_character(smollm2_tokenizer: Tokenizer) -> None:
    # pre="smollm": llama.cpp (and SmolLM2's own tokenizer.json) split off each \p{N} character
    # before BPE. transformers' GGUF converter does not, so for non-ASCII numbers like "½" it
    # merges the preceding space in ("ĠÂ", "½"); ASCII digits come out the same either way.
    tok = smollm2_tokenizer
    assert tok.convert_ids_to_tokens(tok.encode(" 2024")) == ["Ġ", "2", "0", "2", "4"]
    assert tok.convert_ids_to_tokens(tok.encode(" ½ ²")) == ["Ġ", "Â½", "Ġ", "Â²"]
    assert tok.decode(tok.encode("١٢٣ ½")) == "١٢٣ ½"


# -- llama (SentencePiece BPE with byte fallback), on a synthetic file ------------------------


def test_llama_encodes_and_decodes_corpus_like_transformers(
    tiny_llama_tokenizer: Tokenizer, hf_tiny_llama: Any
) -> None:
    _assert_same_encoding(tiny_llama_tokenizer, hf_tiny_llama, CORPUS)


def test_llama_uses_merges_from_scores_and_byte_fallback(tiny_llama_tokenizer: Tokenizer) -> None:
    tok = tiny_llama_tokenizer
    ids = tok.encode("hello world 文", add_special_tokens=False)
    # "文" is not in the vocabulary: its three UTF-8 bytes become byte tokens.
    assert tok.convert_ids_to_tokens(ids) == ["▁hello", "▁world", "▁", "<0xE6>", "<0x96>", "<0x87>"]
    assert tok.decode(ids) == "hello world 文"


def test_llama_metadata(tiny_llama_tokenizer: Tokenizer, hf_tiny_llama: Any) -> None:
    tok = tiny_llama_tokenizer
    assert tok.vocab_size == len(hf_tiny_llama)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    # The GGUF's end-of-turn token also stops generation.
    assert tok.eos_token_ids == (2, tok.token_to_id("<|im_end|>"))
    assert tok.encode("hello")[0] == tok.bos_token_id  # add_bos_token is set
    assert sorted(tok.special_token_ids) == _reference_special_ids(hf_tiny_llama) == [0, 1, 2, 3, 4]
    # The user-defined token is matched whole but is not special.
    tool_id = tok.token_to_id("<tool>")
    assert tool_id in tok.encode("a<tool>b") and not tok.is_special(tool_id)


def test_llama_without_space_prefix(tmp_path: Path) -> None:
    # transformers ignores add_space_prefix; we follow llama.cpp and add no "▁" in front.
    tok = Tokenizer.from_path(write_llama_gguf(tmp_path / "np.gguf", add_space_prefix=False, add_bos_token=False))
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["he", "ll", "o", "▁world"]
    assert tok.decode(ids) == "hello world"
    assert tok.decode(tok.encode(" indented")) == " indented"


# -- byte-level text splitting per tokenizer.ggml.pre -----------------------------------------


@pytest.mark.parametrize(
    ("pre", "expected_digits"),
    [("llama-bpe", ["Ġ", "123", "45"]), ("qwen2", ["Ġ", "1", "2", "3", "4", "5"]), ("gpt-2", ["Ġ12", "3", "45"])],
)
def test_gpt2_pre_tokenizer_matches_transformers(
    tmp_path: Path, transformers_module: Any, pre: str, expected_digits: list[str]
) -> None:
    path = write_gpt2_gguf(tmp_path / f"{pre}.gguf", pre)
    ours = Tokenizer.from_path(path)
    reference = transformers_module.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    _assert_same_encoding(ours, reference, CORPUS)
    assert ours.convert_ids_to_tokens(ours.encode(" 12345")) == expected_digits


def test_digit_splitting_pre_splits_every_digit(tmp_path: Path) -> None:
    # "smollm" (and starcoder...) split each digit off before BPE, as llama.cpp does.
    tok = Tokenizer.from_path(write_gpt2_gguf(tmp_path / "smollm.gguf", "smollm"))
    assert tok.convert_ids_to_tokens(tok.encode(" 12345")) == ["Ġ", "1", "2", "3", "4", "5"]


def test_gpt2_control_and_user_defined_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_path(write_gpt2_gguf(tmp_path / "t.gguf", "gpt-2"))
    ids = tok.encode("<|im_start|>x<think>y")
    assert ids[0] == 1 and tok.is_special(1)
    think_id = tok.token_to_id("<think>")
    assert think_id in ids and not tok.is_special(think_id)
    assert tok.decode(ids, skip_special_tokens=True) == "x<think>y"


# -- errors ------------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_a_clear_error(tmp_path: Path) -> None:
    path = write_gguf_with_model(tmp_path / "bert.gguf", "bert")
    with pytest.raises(ValueError, match=r"bert\.gguf.*'bert' is not supported") as info:
        Tokenizer.from_path(path)
    assert "\n" not in str(info.value)


def test_gguf_without_tokenizer_metadata(tmp_path: Path) -> None:
    path = write_gguf_without_tokenizer(tmp_path / "bare.gguf")
    with pytest.raises(ValueError, match=r"bare\.gguf.*no tokenizer metadata"):
        Tokenizer.from_path(path)


def test_corrupt_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match=r"broken\.gguf") as info:
        Tokenizer.from_path(path)
    assert "\n" not in str(info.value)
