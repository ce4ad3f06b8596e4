"""The offline API: ``LLM(model=...).generate(prompts, params)``, the engine loop run in-process."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from tokenmill.config import ConfigError, EngineConfig, load_config
from tokenmill.config.options import flag_specs
from tokenmill.engine import EngineCore, now
from tokenmill.lora.request import LoRARequest
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_files import resolve_tokenizer
from tokenmill.output_processor import OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import InvalidRequestError, SamplingParams
from tokenmill.structured_output.validator import ConstraintValidator
from tokenmill.tokenizer import Tokenizer, check_template_kwargs

logger = logging.getLogger(__name__)

#: A prompt: text, or {"prompt": text} / {"prompt_token_ids": [...]}.
Prompt = str | dict[str, Any]
Conversation = list[dict[str, Any]]


def config_from_kwargs(config_file: str | Path | None, model: str | None, **settings: Any) -> EngineConfig:
    """Build an ``EngineConfig`` from flat keyword arguments named like the CLI flags (``block_size=32``,
    ``attention_backend="torch"``, ``scheduling_policy="priority"``, as vLLM's ``LLM`` takes them) or like
    a config field where that name is unambiguous, on top of an optional TOML file."""
    paths = keyword_paths()
    overrides: dict[str, Any] = {}
    if model is not None:
        overrides["model"] = {"model": model}
    for name, value in settings.items():
        path = paths.get(name)
        if path is None:
            raise ConfigError(f"unknown setting {name!r}; valid settings: {', '.join(sorted(paths))}")
        target = overrides
        for section in path[:-1]:
            target = target.setdefault(section, {})
        target[path[-1]] = value
    return load_config(config_file, overrides)


def keyword_paths() -> dict[str, tuple[str, ...]]:
    """``LLM(...)`` keyword -> config path: each flag's name, and each field's name unless two fields share it
    (``model`` is both ``model.model`` and ``speculative_config.model``)."""
    specs = flag_specs()
    # A section given as one JSON flag is one keyword taking a dict (speculative_config={...}).
    paths = {spec.flag.removeprefix("--").replace("-", "_"): spec.path[:-1] if spec.json_key else spec.path
             for spec in specs}  # fmt: skip
    field_names = [spec.path[-1] for spec in specs]
    for spec in specs:
        if field_names.count(spec.path[-1]) == 1:
            paths.setdefault(spec.path[-1], spec.path)
    return paths


class LLM:
    """An engine in this process, with its tokenizer.

    ``LLM(model=None)`` serves the default model; any config field can be given
    by name (``LLM(model=path, block_size=32, dtype="float32")``), or a TOML
    file with ``config=``.
    """

    def __init__(self, model: str | None = None, *, config: str | Path | None = None, **settings: Any) -> None:
        self._start(config_from_kwargs(config, model, **settings))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` for an already resolved config (the CLI's)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = EngineCore(self.config)
        tokenizer_path = resolve_tokenizer(self.config.model.model, self.config.model.tokenizer)
        self.tokenizer = Tokenizer.from_path(tokenizer_path)
        self._ids = itertools.count()
        self._validator: ConstraintValidator | None = None

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_finished: Callable[[int, RequestOutput], None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in order.

        ``on_finished(i, output)`` is called as soon as prompt ``i`` finishes, so a caller
        can write results while the rest are still running. ``lora_request``: the LoRA adapter every prompt
        runs with, or one per prompt (None: the base model); needs ``LLM(..., enable_lora=True)``.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        encoded = [self._encode(p) for p in prompt_list]
        return self._run(encoded, sampling_params, use_tqdm, on_finished, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate (with ``lora_request`` as in
        ``generate``).

        ``chat_template_kwargs`` (vLLM's argument, e.g. ``{"enable_thinking": False}``) and any other keyword
        arguments become template variables, over the config's ``server.default_chat_template_kwargs``; a key
        the renderer sets itself (``messages``, ``tools``, ...) in ``chat_template_kwargs`` raises
        ``InvalidRequestError``.
        """
        conversations = cast(
            list[Conversation], [messages] if messages and isinstance(messages[0], dict) else list(messages)
        )
        try:
            check_template_kwargs(chat_template_kwargs or {})
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        variables = {**(chat_template_kwargs or {}), **template_kwargs}
        encoded: list[tuple[str | None, list[int]]] = [
            self.render_chat(c, add_generation_prompt, **variables) for c in conversations
        ]
        return self._run(encoded, sampling_params, use_tqdm, lora_request=lora_request)

    def render_chat(
        self, conversation: Conversation, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids the chat template makes of ``conversation``, with ``template_kwargs``
        over the config's ``server.default_chat_template_kwargs``."""
        variables = {**self.config.server.default_chat_template_kwargs, **template_kwargs}
        text = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, **variables
        )
        assert isinstance(text, str)
        # The template already wrote BOS and the other special tokens as text.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidRequestError("a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        on_finished: Callable[[int, RequestOutput], None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        params_list = _params_per_prompt(sampling_params, len(encoded))
        loras = _loras_per_prompt(lora_request, len(encoded))
        for params in params_list:
            self._check_constraint(params)
        processor = OutputProcessor(self.tokenizer)
        results: dict[str, RequestOutput] = {}
        request_ids = []
        for (prompt, token_ids), params, lora in zip(encoded, params_list, loras, strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(
                EngineCoreRequest(
                    request_id, token_ids, params, list(self.tokenizer.eos_token_ids), now(), lora_request=lora
                )
            )
            results[request_id] = processor.add_request(request_id, prompt, token_ids, params)
            request_ids.append(request_id)
        position = {request_id: i for i, request_id in enumerate(request_ids)}
        with tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                step = processor.process(self.engine.step())
                if step.to_abort:
                    processor.process(self.engine.abort_requests(step.to_abort, completions_only=True))
                for output in step.updated:
                    if output.finished and output.request_id in position:
                        progress.update(1)
                        index = position.pop(output.request_id)
                        if on_finished is not None:
                            on_finished(index, output)
        return [results[request_id] for request_id in request_ids]

    def _check_constraint(self, params: SamplingParams) -> None:
        """A ``structured_outputs`` constraint that cannot compile raises ``InvalidRequestError`` naming the problem,
        before anything is queued (when the backend checks without compiling in the engine)."""
        if params.structured_outputs is None:
            return
        if self._validator is None:
            backend = self.config.structured_outputs_config.backend
            self._validator = ConstraintValidator(self.engine.plugins, backend, self.tokenizer, self.engine.vocab_size)
        try:
            self._validator.validate(params.structured_outputs)
        except ValueError as exc:
            raise InvalidRequestError(f"structured_outputs cannot be used: {exc}") from None


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def _loras_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise InvalidRequestError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras
