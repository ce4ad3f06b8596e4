"""`tokenmill generate`: JSONL in, JSONL out, bad lines reported and skipped, resumable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.batch_generate import _done_ids, _write, parse_line

pytestmark = pytest.mark.slow


def _generate(input_path: Path, output_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "generate", "--input", str(input_path), "--output", str(output_path),
         "--device", "cpu", "--kv-cache-memory", "256MiB"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def test_200_prompts_with_the_default_model_and_bad_lines(tmp_path: Path, smollm2_gguf: Path) -> None:
    lines = [
        json.dumps({"id": f"p{i}", "prompt": f"Question {i}: name a colour.", "max_tokens": 4}) for i in range(200)
    ]
    lines.insert(50, '{"id": "broken", "prompt": "unterminated')
    lines.insert(120, json.dumps({"id": "bad-params", "prompt": "hi", "temperature": -1}))
    lines.insert(7, json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}))
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("\n".join(lines) + "\n")

    result = _generate(input_path, output_path)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in output_path.read_text().splitlines()]
    by_id = {record["id"]: record for record in records}
    assert len(records) == len(by_id) == 203
    assert by_id["bad-params"] == {
        "id": "bad-params", "line": 122, "error": "temperature=-1.0 is invalid: must be at least 0"
    }  # fmt: skip
    # Not JSON, so its id is unreadable: the record is keyed by line number.
    assert by_id["52"]["line"] == 52 and by_id["52"]["error"].startswith("not valid JSON")
    results = [r for r in records if "outputs" in r]
    assert len(results) == 201
    for record in results:
        (completion,) = record["outputs"]
        assert 1 <= completion["num_tokens"] <= (3 if record["id"] == "chat" else 4)
        assert completion["finish_reason"] in ("stop", "length")
        assert record["usage"]["completion_tokens"] == completion["num_tokens"]
    assert "201 completed, 2 errors, 0 already in" in result.stderr
    assert "generating" in result.stderr  # the progress bar

    # A rerun finds every id in the output and computes nothing.
    before = output_path.read_text()
    rerun = _generate(input_path, output_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "0 completed, 0 errors, 203 already in" in rerun.stderr
    assert output_path.read_text() == before


def test_resume_runs_only_missing_ids(tmp_path: Path, smollm2_gguf: Path) -> None:
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("\n".join(json.dumps({"prompt": f"Count to {i}", "max_tokens": 2}) for i in range(4)) + "\n")
    # An earlier run finished lines 1 and 3 (ids default to line numbers) and was cut mid-write.
    output_path.write_text('{"id": "1", "outputs": []}\n{"id": "3", "outputs": []}\n{"id": "2", "outp')
    result = _generate(input_path, output_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 completed, 0 errors, 2 already in" in result.stderr
    ids = [json.loads(line)["id"] for line in output_path.read_text().splitlines()]
    assert ids[:2] == ["1", "3"] and sorted(ids[2:]) == ["2", "4"]  # the cut-off line was dropped


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt": "x", "temprature": 1}', "unknown field(s) temprature"),
        ('{"max_tokens": 3}', "give exactly one of 'prompt'"),
        ('{"prompt": 3}', "'prompt' must be a string"),
        ('{"prompt": "x", "max_tokens": "many"}', "Expected `int | null`, got `str`"),
    ],
)
def test_parse_line_errors(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        parse_line(line, 1)


def test_records_with_unicode_line_breaks_stay_one_line_each(tmp_path: Path) -> None:
    """JSON leaves U+0085, U+2028 and U+2029 unescaped and ``str.splitlines`` breaks lines at them (a generated text
    held one): the output escapes them, and resuming splits at newlines only, so it finds such a record's id even in
    a file another tool wrote."""
    output_path = tmp_path / "out.jsonl"
    text = "x\u2028y\x85z\u2029"
    with output_path.open("a", encoding="utf-8") as out:
        _write(out, {"id": "a", "text": text})
        _write(out, {"id": "b", "text": "plain"})
    lines = output_path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["text"] for line in lines] == [text, "plain"]
    output_path.write_text(json.dumps({"id": "c", "text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert _done_ids(output_path) == {"c"}
