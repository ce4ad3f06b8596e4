"""Building blocks shared by model architectures: ``Linear`` over a ``Quantizer``,
``RMSNorm``, rotary embedding. ``plugin`` registers the built-in dense quantizer.
This package imports nothing on its own, so the registration stays free of torch.
"""
