"""Rendering chat templates the way Hugging Face ``transformers`` does.

Chat templates are Jinja2 programs shipped with a model (in
``tokenizer_config.json``, ``chat_template.jinja`` or GGUF metadata). They are
untrusted code, so they run in Jinja's immutable sandbox. The environment
mirrors ``transformers``: ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not HTML-escape,
and the ``raise_exception`` and ``strftime_now`` globals. Inputs are copied
into plain JSON-like data first, so a template never sees caller objects.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

# A message's reasoning goes by several names; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

#: Names extra template variables (``chat_template_kwargs``) may not take: the renderer sets the first four from
#: the request itself, and the last two are arguments of ``apply_chat_template``, not template variables (vLLM
#: refuses those two too).
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize")


def check_template_kwargs(template_kwargs: Mapping[str, Any], name: str = "chat_template_kwargs") -> None:
    """Raise ``ValueError`` naming ``name`` and the key when ``template_kwargs`` sets a reserved variable.

    Called once per request (API front end) or per ``LLM.chat`` call, and once on the server's default.
    """
    reserved = [key for key in template_kwargs if key in RESERVED_TEMPLATE_VARIABLES]
    if reserved:
        raise ValueError(
            f"{name} cannot set {reserved[0]!r}: messages, tools, documents and add_generation_prompt come from "
            "the request itself, and chat_template and tokenize are not template variables"
        )


class ChatTemplate:
    """A compiled chat template.

    Compile once per model (``Tokenizer`` does this on first use) and call
    ``render`` per request, in the API front end process.
    """

    def __init__(self, source: str) -> None:
        """Compile ``source``; raises ``ValueError`` on a Jinja syntax error."""
        self.source = source
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template syntax error on line {exc.lineno}: {_one_line(exc)}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text.

        Message keys whose value is ``None`` are dropped (many templates
        render them as the string "None"), and reasoning given as
        ``reasoning``/``thinking``/``reasoning_content`` is copied under all
        three names. Extra keyword arguments become template variables
        (``bos_token``, ``enable_thinking``, ...). Raises ``ValueError`` with
        a one-line message when the conversation is empty or the template
        fails (including its own ``raise_exception`` calls).
        """
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
            chat.append(_alias_reasoning({k: _plain(v) for k, v in message.items() if v is not None}))
        variables = {name: _plain(value) for name, value in template_kwargs.items()}
        try:
            return self._template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {_one_line(exc)}") from exc
        except Exception as exc:  # the template is user code; any failure in it is a bad template or input
            raise ValueError(f"chat template failed with {type(exc).__name__}: {_one_line(exc)}") from exc


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Compile ``template`` and render ``messages`` with it (see ``ChatTemplate.render``)."""
    return ChatTemplate(template).render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _make_dict
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes `<`, `>`, `&` and `'`, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    # A plain function instead of the `dict` type, so templates cannot reach the class itself.
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses underscore names, keeping templates away from dunders."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _plain(value: Any) -> Any:
    """Copy ``value`` into plain JSON-like data; other objects become a ``<TypeName>`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    # gpt-oss templates read `thinking`, most others `reasoning_content`.
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
