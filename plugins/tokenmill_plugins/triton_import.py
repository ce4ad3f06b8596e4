"""Importing Triton kernel modules, which a CPU install may lack, with the one-line error the plugins share."""

from __future__ import annotations

import importlib
from types import ModuleType

from tokenmill import PluginError


def import_triton_kernels(module: str, plugin: str, instead: str) -> ModuleType:
    """The Triton kernel ``module``; where Triton is missing, a ``PluginError`` saying that ``plugin`` needs it,
    how to install it, and ``instead``: the setting that selects something else."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        raise PluginError(
            f"{plugin} needs Triton, which is not installed: pip install 'tokenmill[gpu]', or {instead}"
        ) from exc


def load_gpu_kernels(module: str, plugin: str, instead: str) -> ModuleType:
    """``import_triton_kernels``, then what a GPU plugin checks when it is built: a CUDA device, or kernels
    decorated for the Triton interpreter (``TRITON_INTERPRET=1``: tests on a CPU); else a ``PluginError``. The
    module must have ``is_interpreted()``."""
    import torch

    kernels = import_triton_kernels(module, plugin, instead)
    if not torch.cuda.is_available() and not kernels.is_interpreted():
        raise PluginError(
            f"no CUDA device found: {plugin} runs on CPU only under the Triton interpreter (TRITON_INTERPRET=1 in "
            f"the environment; slow: for tests); {instead}"
        )
    return kernels
