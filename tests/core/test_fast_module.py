"""FastModule calls forward directly, and goes through nn.Module's call whenever a hook would run."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.fast_module import FastModule


class Double(FastModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def test_without_hooks_the_call_is_forward() -> None:
    calls = []
    module = Double()
    original = nn.Module.__call__
    try:
        nn.Module.__call__ = lambda self, *a, **k: calls.append(1)  # type: ignore[method-assign]
        assert module(torch.ones(1)).item() == 2.0
    finally:
        nn.Module.__call__ = original  # type: ignore[method-assign]
    assert not calls


def test_module_and_global_hooks_still_run() -> None:
    module = Double()
    seen = []
    handle = module.register_forward_pre_hook(lambda _module, args: (args[0] + 1,))
    assert module(torch.ones(1)).item() == 4.0  # (1 + 1) * 2: the pre-hook replaced the input
    handle.remove()
    handle = module.register_forward_hook(lambda _module, _args, out: out * 10)
    assert module(torch.ones(1)).item() == 20.0
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda _module, _args, out: seen.append(out))
    try:
        module(torch.ones(1))
    finally:
        handle.remove()
    assert len(seen) == 1 and module(torch.ones(1)).item() == 2.0
