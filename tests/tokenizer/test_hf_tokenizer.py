"""Loading a tokenizer from a Hugging Face model directory, checked against transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer.conftest import CORPUS
from tokenmill.tokenizer import Tokenizer

CONFIG_TEMPLATE = "{% for m in messages %}config template {{ m['content'] }}{% endfor %}"
FILE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "中文 🙂"},
]


def _write_model_dir(directory: Path, tokenizer_json: dict[str, Any], config: dict[str, Any]) -> Path:
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def tiny_llama_json(tiny_llama_tokenizer: Tokenizer) -> dict[str, Any]:
    """tokenizer.json of the synthetic llama vocabulary; its post-processor adds BOS."""
    return json.loads(tiny_llama_tokenizer.backend.to_str())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_json: dict[str, Any]) -> Path:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,  # transformers 5 ignores this when tokenizer.json exists; so do we
        "add_eos_token": True,
        "chat_template": CONFIG_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip
    directory = _write_model_dir(tmp_path_factory.mktemp("hf") / "llama", tiny_llama_json, config)
    (directory / "chat_template.jinja").write_text(FILE_TEMPLATE, encoding="utf-8")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def hf_llama_dir(llama_dir: Path, transformers_module: Any) -> Any:
    return transformers_module.AutoTokenizer.from_pretrained(str(llama_dir))


def test_directory_encodes_and_decodes_like_transformers(llama_dir: Path, hf_llama_dir: Any) -> None:
    tok = Tokenizer.from_path(llama_dir)
    for text in CORPUS:
        for add_special_tokens in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special_tokens)
            assert ids == hf_llama_dir.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_llama_dir.decode(ids, skip_special_tokens=skip)


def test_directory_settings(llama_dir: Path, hf_llama_dir: Any) -> None:
    tok = Tokenizer.from_path(llama_dir)
    assert (tok.bos_token, tok.bos_token_id) == ("<s>", 1)  # from the AddedToken dict form
    assert (tok.eos_token, tok.eos_token_id) == ("</s>", 2)
    assert tok.eos_token_ids == (2, 4)  # eos first, then generation_config's list
    assert tok.pad_token_id is None
    # The post-processor of tokenizer.json adds BOS; the config flags do not change that.
    ids = tok.encode("hello")
    assert ids[0] == 1 and ids[-1] != 2
    assert tok.chat_template == FILE_TEMPLATE  # chat_template.jinja wins over the config's
    assert hf_llama_dir.chat_template == FILE_TEMPLATE


def test_directory_chat_template_like_transformers(llama_dir: Path, hf_llama_dir: Any) -> None:
    tok = Tokenizer.from_path(llama_dir)
    for add_generation_prompt in (True, False):
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
        expected = hf_llama_dir.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert text == expected
        assert text.startswith("<s>[system] Be brief.</s>\n")
        ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
        reference = hf_llama_dir.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        assert ids == list(reference)
        assert ids.count(1) == 1  # the template writes BOS; tokenizing adds no second one


def test_named_special_token_outside_added_tokens_becomes_special(
    tmp_path: Path, tiny_llama_json: dict[str, Any], transformers_module: Any
) -> None:
    # "</s>" here is an ordinary vocabulary entry; naming it eos_token makes it special (transformers too).
    data = json.loads(json.dumps(tiny_llama_json))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "</s>"]
    data["post_processor"] = None
    directory = _write_model_dir(tmp_path / "m", data, {"eos_token": "</s>", "bos_token": "<s>"})
    tok = Tokenizer.from_path(directory)
    reference = transformers_module.AutoTokenizer.from_pretrained(str(directory))
    ids = tok.encode("a</s>b")
    assert ids == reference.encode("a</s>b")
    assert 2 in ids and tok.is_special(2)
    assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert tok.encode("hello")[0] != 1  # no post-processor: nothing added


def test_named_chat_templates_use_default(tmp_path: Path, tiny_llama_json: dict[str, Any]) -> None:
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    tok = Tokenizer.from_path(_write_model_dir(tmp_path / "m", tiny_llama_json, {"chat_template": templates}))
    assert tok.chat_template == "plain"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json.*not found") as info:
        Tokenizer.from_path(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_file_is_named(tmp_path: Path, tiny_llama_json: dict[str, Any], broken: str) -> None:
    directory = _write_model_dir(tmp_path / "m", tiny_llama_json, {})
    (directory / broken).write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=broken.replace(".", r"\.")) as info:
        Tokenizer.from_path(directory)
    assert "\n" not in str(info.value)
