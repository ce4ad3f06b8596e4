"""Plugin packages installed as a user installs them: by pip, outside the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["install_package", "pythonpath_env"]


def install_package(source: Path, target: Path) -> Path:
    """``pip install --no-deps --no-build-isolation --target TARGET SOURCE``: builds the package at ``source``
    (a folder with a pyproject.toml) into ``target``, a folder of its own; returns ``target``. Point
    ``PYTHONPATH`` at it (``pythonpath_env``) for the processes that should see the plugin.

    :raises subprocess.CalledProcessError: with pip's output, if the build or install fails.
    """
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
               "--target", str(target), str(source)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    return target


def pythonpath_env(*folders: Path) -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` with ``folders`` first, then this process's ``PYTHONPATH``: extra environment
    for a subprocess (or ``tokenmill_server(env=...)``) that should import from ``folders``."""
    entries = [str(folder) for folder in folders] + [os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(entry for entry in entries if entry)}
