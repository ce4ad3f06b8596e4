"""A whole decoder stack in one call.

- ``cpu``: a Llama-shaped stack of int4/int8 linears run by the other CPU kernels' C++, one call a step.

Nothing is imported here.
"""

__all__ = ["cpu"]
