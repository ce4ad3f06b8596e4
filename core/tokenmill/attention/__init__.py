"""Attention over a paged KV cache.

``backend`` declares the interface, ``torch_backend`` is the reference
implementation, ``plugin`` registers it. This package imports nothing on its
own, so the registration stays free of torch.
"""
