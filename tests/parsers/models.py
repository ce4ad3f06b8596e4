"""A tiny model whose tokenizer knows Qwen3's thinking markers as single tokens (``<think>``, ``</think>``) and
whose chat template knows tools, as Qwen's does.

Qwen's ``<tool_call>`` markers are added tokens too, but left out here: llguidance 1.9 takes every added token
for a special one, whose text it forces in a grammar's mask and then refuses to consume, so a regex that spells
``<tool_call>`` could not force it."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.testing import save_tiny_model
from tokenmill.testing.factories import save_tiny_tokenizer

MARKERS = ("<think>", "</think>")

#: Qwen 2.5/3's template cut to what tests need: the tools in the system turn with the call format, thinking
#: closed in the prompt with ``enable_thinking=False``.
QWEN_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}"""


def save_qwen_like_model(directory: Path, vocab_size: int = 512) -> Path:
    """A tiny random model (``llama-tiny``) with Qwen's markers as its last ids and ``QWEN_TEMPLATE``."""
    save_tiny_model(directory)
    save_tiny_tokenizer(directory, vocab_size - len(MARKERS))
    tokenizer = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in MARKERS])
    assert tokenizer.get_vocab_size() == vocab_size
    tokenizer.save(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return directory
