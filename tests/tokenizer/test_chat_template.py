"""Chat templates must render exactly as transformers' ``apply_chat_template(..., tokenize=False)``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from tokenmill.tokenizer import (
    RESERVED_TEMPLATE_VARIABLES,
    ChatTemplate,
    Tokenizer,
    check_template_kwargs,
    render_chat_template,
)

# Llama 3.2 style: system block with date, tools as JSON (indent=4), tool calls and ipython results.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = false %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{#- Pull out the system message so it can go into the system block. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions.\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen 2.5 style: tools inside the system block, <tool_call> and <tool_response> blocks.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Exercises loop controls, namespace, reasoning aliases and tojson options.
FEATURES_TEMPLATE = """{% set ns = namespace(count=0) %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {{ ns.count }}:{{ m.role }}:{{ m.content }}
    {% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
    {% if m.thinking is defined %}[{{ m.thinking }}]{% endif %}
{% endfor %}
{{ extra | tojson(indent=2, sort_keys=true) }}
{{ extra | tojson(separators=(',', ':')) }}
{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, in °C <b>bold</b> & 'quoted'",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. 東京"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And in 日本語? 🙂\nThanks"},
    ],
    [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,  # API clients send None here; it must be dropped, not rendered
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21, "unit": "°C"}'},
        {"role": "assistant", "content": "It is 21 °C in Paris."},
    ],
]


def _reference(hf: Any, template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_model_template_matches_transformers(
    smollm2_tokenizer: Tokenizer, hf_smollm2: Any, add_generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS[:2]:
        ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        expected = hf_smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert ours == expected
    first = smollm2_tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=add_generation_prompt)
    assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert first.endswith("<|im_start|>assistant\n") is add_generation_prompt


def test_model_template_tokenized_matches_transformers(smollm2_tokenizer: Tokenizer, hf_smollm2: Any) -> None:
    ids = smollm2_tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=True)
    expected = hf_smollm2.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert ids[0] == smollm2_tokenizer.bos_token_id and ids.count(smollm2_tokenizer.eos_token_id) == 4


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, QWEN_TEMPLATE], ids=["llama3", "qwen"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_real_world_templates_match_transformers(
    smollm2_tokenizer: Tokenizer, hf_smollm2: Any, template: str, with_tools: bool
) -> None:
    special = dict(smollm2_tokenizer.special_tokens_map())
    tools = TOOLS if with_tools else None
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            kwargs: dict[str, Any] = {"tools": tools, "add_generation_prompt": add_generation_prompt}
            if template is LLAMA3_TEMPLATE:
                kwargs["date_string"] = "26 Jul 2024"
            ours = render_chat_template(template, messages, **special, **kwargs)
            assert ours == _reference(hf_smollm2, template, messages, **kwargs)
            assert "None" not in ours
    if with_tools:
        assert "°C <b>bold</b> & 'quoted'" in ours and "東京" in ours  # tojson does not escape


def test_template_features_match_transformers(smollm2_tokenizer: Tokenizer, hf_smollm2: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "b"},
        {"role": "assistant", "content": "c", "reasoning": "because"},
        {"role": "assistant", "content": "d", "reasoning_content": "why"},
        {"role": "stop", "content": "e"},
        {"role": "user", "content": "never"},
    ]
    extra = {"b": [1, 2.5, None, True], "a": "ü<>&"}
    special = dict(smollm2_tokenizer.special_tokens_map())
    ours = render_chat_template(FEATURES_TEMPLATE, messages, add_generation_prompt=True, extra=extra, **special)
    assert ours == _reference(hf_smollm2, FEATURES_TEMPLATE, messages, add_generation_prompt=True, extra=extra)
    assert "never" not in ours and "b" not in ours.split("\n")[1]
    assert "<think>because</think>" in ours and "[why]" in ours  # aliased both ways
    assert '{"b":[1,2.5,null,true],"a":"ü<>&"}' in ours  # no HTML escaping, no ASCII escaping
    assert '{\n  "a": "ü<>&",\n  "b": [\n    1,' in ours  # indent and sort_keys


def test_template_kwargs_override_special_tokens(smollm2_tokenizer: Tokenizer) -> None:
    text = smollm2_tokenizer.apply_chat_template(CONVERSATIONS[0], bos_token="<BOS>")
    assert isinstance(text, str)
    plain = render_chat_template("{{ bos_token }}{{ eos_token }}", CONVERSATIONS[0], bos_token="<BOS>", eos_token="E")
    assert plain == "<BOS>E"


def test_strftime_now() -> None:
    before = datetime.now().strftime("%Y-%m-%d")
    text = render_chat_template("{{ strftime_now('%Y-%m-%d') }}", CONVERSATIONS[0])
    assert text in {before, datetime.now().strftime("%Y-%m-%d")}


def test_raise_exception_becomes_one_line_value_error() -> None:
    messages = [{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}, {"function": {}}]}]
    with pytest.raises(ValueError, match="only supports single tool-calls") as info:
        render_chat_template(LLAMA3_TEMPLATE, messages, bos_token="", date_string="x")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        ("{% for m in messages %}{{ m.content }", "syntax error on line 1"),
        ("{% if %}\n{% endif %}", "syntax error on line 1"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
        ("{{ messages.append(1) }}", "unsafe|append"),
    ],
)
def test_template_errors_are_one_line_value_errors(template: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        render_chat_template(template, CONVERSATIONS[0])
    assert "\n" not in str(info.value)


def test_empty_conversation_and_bad_messages() -> None:
    template = ChatTemplate("{{ messages | length }}")
    assert template.render(CONVERSATIONS[1]) == "4"
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([])
    with pytest.raises(ValueError, match="must be dicts"):
        template.render(["hello"])  # type: ignore[list-item]


def test_inputs_are_copied_into_plain_data() -> None:
    class Opaque:
        secret = "hidden"

    messages = [{"role": "user", "content": "hi", "obj": Opaque()}]
    text = render_chat_template("{{ messages[0].obj }}|{{ messages[0].obj.secret }}", messages)
    assert text == "<Opaque>|"
    assert isinstance(messages[0]["obj"], Opaque)  # the caller's messages are untouched


def test_template_kwargs_reach_the_template_but_not_the_renderers_own_names() -> None:
    # Qwen3's switch: enable_thinking=False closes an empty thinking block in the prompt.
    template = "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{{ who }}"
    assert render_chat_template(template, CONVERSATIONS[0], enable_thinking=False, who="w") == "<think></think>w"
    assert render_chat_template(template, CONVERSATIONS[0], who="w") == "w"
    check_template_kwargs({"enable_thinking": False, "bos_token": "", "custom_tools": []})
    for name in RESERVED_TEMPLATE_VARIABLES:
        with pytest.raises(ValueError, match=f"^the default cannot set '{name}': messages, tools, documents"):
            check_template_kwargs({"enable_thinking": True, name: None}, "the default")
