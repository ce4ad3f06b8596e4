"""The ``Tokenizer`` front: loading from a path, the encode/decode API, and what it must not import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

from tests.tokenizer.conftest import CORPUS
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.source import TokenizerSource


def test_importing_the_tokenizer_loads_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, tokenmill.tokenizer\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "none"


def test_byte_level_round_trip_is_lossless(smollm2_tokenizer: Tokenizer) -> None:
    for text in CORPUS:
        assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_special_token_strings_in_text_map_to_their_ids(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert (ids[0], ids[-1]) == (tok.bos_token_id, tok.eos_token_id)
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|im_start|>", "user"]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_convert_ids_rejects_unknown_ids(smollm2_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \(size 49152\)"):
        smollm2_tokenizer.convert_ids_to_tokens([1, 49152])


def test_from_path_accepts_a_tokenizer_json_file(tmp_path: Path, tiny_llama_tokenizer: Tokenizer) -> None:
    tiny_llama_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_path(tmp_path / "tokenizer.json")
    assert tok.path == tmp_path
    assert tok.encode("hello world") == tiny_llama_tokenizer.encode("hello world")


def test_from_path_detects_gguf_without_the_suffix(tmp_path: Path, tiny_llama_gguf: Path) -> None:
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(tiny_llama_gguf.read_bytes())
    assert Tokenizer.from_path(renamed).vocab_size > 256


@pytest.mark.parametrize("name", ["missing", "weights.safetensors"])
def test_from_path_errors_name_the_path(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name != "missing":
        path.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as info:
        Tokenizer.from_path(path)
    assert "\n" not in str(info.value)


def test_explicit_flags_rebuild_the_post_processor(tiny_llama_tokenizer: Tokenizer) -> None:
    backend = tokenizers.Tokenizer.from_str(tiny_llama_tokenizer.backend.to_str())
    source = TokenizerSource(
        path=Path("mem"), backend=backend, bos_token="<s>", eos_token="</s>", add_bos_token=False, add_eos_token=True
    )
    tok = Tokenizer(source)
    ids = tok.encode("hello")
    assert ids[0] != 1 and ids[-1] == 2
    assert tok.encode("hello", add_special_tokens=False) == ids[:-1]


def test_model_without_chat_template(tiny_llama_tokenizer: Tokenizer) -> None:
    backend = tokenizers.Tokenizer.from_str(tiny_llama_tokenizer.backend.to_str())
    tok = Tokenizer(TokenizerSource(path=Path("mem"), backend=backend))
    assert tok.chat_template is None and tok.bos_token_id is None and tok.eos_token_ids == ()
    with pytest.raises(ValueError, match="mem: the model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
