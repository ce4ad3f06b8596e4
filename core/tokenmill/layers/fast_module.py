"""``FastModule``: an ``nn.Module`` whose call goes straight to ``forward`` while no hook is registered.

``nn.Module.__call__`` passes through two Python functions and a tracing check before ``forward``: about a
microsecond a call. A decode step of the default model calls about 270 modules, so at one token that is 0.3 ms
of a 9 ms step (docs/benchmarks.md, "Per-step overhead"). The modules of tokenmill's models derive from this
instead. Where a hook is registered, on the module or globally (the quantize pipeline's calibration registers
forward pre-hooks on linears), or while ``torch.jit`` traces, the call goes through ``nn.Module.__call__`` as
before, so hooks behave exactly as torch documents them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module


class FastModule(nn.Module):
    """An ``nn.Module`` that calls ``forward`` directly when nothing would run around it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or _torch_module._global_forward_hooks
            or _torch_module._global_forward_pre_hooks
            or _torch_module._global_backward_hooks
            or _torch_module._global_backward_pre_hooks
            or torch._C._get_tracing_state()
        ):
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)
