"""llama.cpp's own converter, ``convert_hf_to_gguf.py``, for tests of the GGUF files it writes.

The converter ships in the llama-cpp-python sdist (``vendor/llama.cpp``; its ``conversion`` package and its own
``gguf-py``). ``converter_dir`` downloads that sdist once with ``pip download`` and keeps the three parts in the
tokenmill cache (``TOKENMILL_CACHE_DIR``); where pip cannot fetch it the calling test is skipped with pip's reason.
The converter's Python dependencies (torch, numpy, sentencepiece, transformers) are the test suite's.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from tokenmill import envs

#: The sdist the converter comes from: the llama.cpp docs/benchmarks.md compares against.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Runs the converter once per (model dir, out file, out type) triple of argv, in one process (its imports take
# seconds). The tiny tokenizers are no released model's, so the converter cannot name a BPE tokenizer's
# pre-tokenizer from the hash of its output, and refuses; it is named "default" (GPT-2's split) instead. The
# tensors and the model's metadata are the converter's own.
_RUNNER = """
import runpy, sys
root, jobs = sys.argv[1], sys.argv[2:]
sys.path[0:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
for i in range(0, len(jobs), 3):
    model_dir, outfile, outtype = jobs[i : i + 3]
    sys.argv = [root + "/convert_hf_to_gguf.py", model_dir, "--outfile", outfile, "--outtype", outtype]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_dir() -> Path:
    """The directory holding ``convert_hf_to_gguf.py``, downloaded on first use; skips the test if pip cannot."""
    target = envs.TOKENMILL_CACHE_DIR.get().expanduser() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        requirement = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet"]
        result = subprocess.run([*command, "-d", tmp, requirement], capture_output=True, text=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if result.returncode != 0 or len(archives) != 1:
            lines = (result.stderr or result.stdout).strip().splitlines() or ["no sdist"]
            pytest.skip(f"llama.cpp's converter is unavailable: pip download {requirement}: {lines[-1]}")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        unpacked = Path(tmp) / "llama.cpp"
        with tarfile.open(archives[0]) as archive:
            members = []
            for member in archive.getmembers():
                relative = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and relative.startswith(_PARTS) and member.isfile():
                    member.name = relative
                    members.append(member)
            archive.extractall(unpacked, members=members, filter="data")
        try:
            os.replace(unpacked, target)  # atomic: a concurrent test run sees all of it or none
        except OSError:
            if not (target / "convert_hf_to_gguf.py").is_file():
                raise
    return target


def convert(jobs: list[tuple[Path, Path, str]]) -> None:
    """Convert each ``(model_dir, outfile, outtype)`` with llama.cpp's converter (``outtype``: ``f32``, ``q8_0``,
    ...); raises ``AssertionError`` with the end of its output when it fails."""
    root = converter_dir()
    argv = [str(item) for job in jobs for item in job]
    result = subprocess.run([sys.executable, "-c", _RUNNER, str(root), *argv], capture_output=True, text=True)
    assert result.returncode == 0, f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}"


def save_tiny_sentencepiece(directory: Path) -> None:
    """A small SentencePiece ``tokenizer.model`` (BPE with byte fallback, ~300 pieces), as Gemma, Phi-3 and
    Mixtral ship theirs; the converter reads it (and needs it for Gemma 2)."""
    import sentencepiece

    lines = ["the quick brown fox jumps over the lazy dog", "hello world", "tiny models for tests"] * 20
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
