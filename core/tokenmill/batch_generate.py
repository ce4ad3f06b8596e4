"""``tokenmill generate``: a JSONL file of prompts in, a JSONL file of results out.

Each input line is an object with ``prompt`` (text) or ``messages`` (a chat),
an optional ``id`` (default: the line number), and any ``SamplingParams``
field (``max_tokens``, ``temperature``, ...). Each result line is
``{"id", "outputs": [{"index", "text", "finish_reason", "num_tokens"}], "usage"}``,
or ``{"id", "line", "error"}`` for a line that could not be run. Results are
appended as requests finish, so an interrupted run loses nothing finished, and
a rerun skips every id already in the output.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import msgspec

from tokenmill.errors import TokenmillError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PROMPT_KEYS = ("id", "prompt", "messages")
_PARAM_FIELDS = frozenset(SamplingParams.__struct_fields__)


@dataclass(frozen=True)
class BatchItem:
    id: str
    line: int
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams


@dataclass(frozen=True)
class BatchSummary:
    num_lines: int
    num_skipped: int  # already in the output
    num_errors: int
    num_completed: int


def parse_line(text: str, line: int) -> BatchItem:
    """One input line as a request. Raises ``ValueError`` with a message for the error record."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(_PROMPT_KEYS) - _PARAM_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; expected prompt or messages, id, and sampling fields")
    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of 'prompt' (a string) or 'messages' (a list of chat messages)")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string")
    if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise ValueError("'messages' must be a list of objects with 'role' and 'content'")
    try:
        params = msgspec.convert({k: v for k, v in record.items() if k in _PARAM_FIELDS}, SamplingParams)
    except (msgspec.ValidationError, TokenmillError) as exc:
        raise ValueError(str(exc)) from None
    return BatchItem(str(record.get("id", line)), line, prompt, messages, params)


def _drop_partial_last_line(output_path: Path) -> None:
    """An interrupted run can leave a half-written last line; cut it so appends start on a fresh line."""
    if not output_path.exists():
        return
    data = output_path.read_bytes()
    if data and not data.endswith(b"\n"):
        with output_path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _lines(path: Path) -> list[str]:
    """A JSONL file's lines, split at newlines only (JSON Lines): ``str.splitlines`` also splits at U+0085, U+2028
    and U+2029, which a JSON string may hold unescaped."""
    return path.read_text(encoding="utf-8").split("\n")


def _done_ids(output_path: Path) -> set[str]:
    if not output_path.exists():
        return set()
    done = set()
    for text in _lines(output_path):
        try:
            done.add(str(json.loads(text)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # not a record of ours: its id, if any, runs again
    return done


#: Characters JSON leaves unescaped that ``str.splitlines`` (and JavaScript before ES2019) take for line breaks.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _write(out: TextIO, record: dict[str, Any]) -> None:
    # Escaped (only ever inside strings here), so that any reader finds one record a line.
    out.write(json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS) + "\n")
    out.flush()


def _result_record(item: BatchItem, output: RequestOutput) -> dict[str, Any]:
    completions = [
        {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)}
        for c in output.outputs
    ]
    return {
        "id": item.id,
        "outputs": completions,
        "usage": {
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": sum(c["num_tokens"] for c in completions),
            "cached_prompt_tokens": output.num_cached_tokens,
        },
    }


def run_batch(llm: Any, input_path: Path, output_path: Path, use_tqdm: bool = True) -> BatchSummary:
    """Run every new line of ``input_path`` through ``llm`` (a ``tokenmill.LLM``), appending to ``output_path``."""
    _drop_partial_last_line(output_path)
    done = _done_ids(output_path)
    lines = _lines(input_path)
    items: list[BatchItem] = []
    prompts: list[dict[str, Any]] = []
    num_skipped = num_errors = 0
    with output_path.open("a", encoding="utf-8") as out:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                item = parse_line(text, number)
                if item.id in done:
                    num_skipped += 1
                    continue
                if item.messages is not None:
                    prompt, token_ids = llm.render_chat(item.messages)
                else:
                    prompt, token_ids = item.prompt, llm.tokenizer.encode(item.prompt)
                llm.engine.check_prompt(token_ids)
            except (ValueError, TokenmillError) as exc:
                error_id = _id_of(text, number)
                if error_id in done:
                    num_skipped += 1
                    continue
                _write(out, {"id": error_id, "line": number, "error": str(exc).splitlines()[0]})
                num_errors += 1
                continue
            items.append(item)
            prompts.append({"prompt": prompt, "prompt_token_ids": token_ids})

        def write_result(index: int, output: RequestOutput) -> None:
            _write(out, _result_record(items[index], output))

        if items:
            llm.generate(prompts, [item.params for item in items], use_tqdm=use_tqdm, on_finished=write_result)
    return BatchSummary(len(lines), num_skipped, num_errors, len(items))


def _id_of(text: str, line: int) -> str:
    try:
        record = json.loads(text)
        if isinstance(record, dict) and "id" in record:
            return str(record["id"])
    except json.JSONDecodeError:
        pass
    return str(line)
